-- each shard keeps its first limit+offset rows; the client sorts and cuts again
SELECT o_orderkey, o_totalprice FROM orders ORDER BY o_totalprice DESC, o_orderkey LIMIT 5 OFFSET 2

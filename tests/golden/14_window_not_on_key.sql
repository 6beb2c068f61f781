-- a window across shards: filtered rows are gathered, the window runs once
SELECT o_orderkey, rank() OVER (PARTITION BY o_orderstatus ORDER BY o_totalprice DESC) AS r
FROM orders WHERE o_totalprice > 400000

-- a subquery correlated on the distribution key stays on the shard
SELECT count(*) AS n FROM orders
WHERE EXISTS (SELECT 1 FROM lineitem WHERE l_orderkey = o_orderkey AND l_quantity > 49)

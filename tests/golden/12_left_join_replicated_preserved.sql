-- customers without orders must appear once, not once per shard
SELECT c_custkey, count(o_orderkey) AS orders
FROM customer LEFT JOIN orders ON c_custkey = o_custkey
GROUP BY c_custkey ORDER BY orders, c_custkey LIMIT 5

-- different co-location groups: the smaller side is materialized and broadcast
SELECT c_mktsegment, count(*) AS n
FROM orders JOIN customer_d ON o_custkey = c_custkey
GROUP BY c_mktsegment ORDER BY c_mktsegment

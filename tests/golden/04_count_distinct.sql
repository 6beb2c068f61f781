-- DISTINCT arguments join the partial GROUP BY: exact, not approximate
SELECT o_orderstatus, count(DISTINCT o_custkey) AS customers, count(*) AS orders
FROM orders GROUP BY o_orderstatus

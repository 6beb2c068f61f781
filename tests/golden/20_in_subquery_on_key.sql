-- key IN (subquery grouped by the key) is local (TPC-H Q18 shape)
SELECT count(*) AS n FROM orders
WHERE o_orderkey IN (SELECT l_orderkey FROM lineitem GROUP BY l_orderkey HAVING sum(l_quantity) > 200)

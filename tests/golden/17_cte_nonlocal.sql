WITH per_supplier AS (
  SELECT l_suppkey AS supplier, sum(l_extendedprice) AS revenue FROM lineitem GROUP BY l_suppkey)
SELECT s_name, revenue FROM supplier JOIN per_supplier ON s_suppkey = supplier
ORDER BY revenue DESC, s_name LIMIT 3

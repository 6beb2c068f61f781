-- correlated on another column: decorrelated into a grouped stage, broadcast back
SELECT count(*) AS n FROM lineitem, part
WHERE p_partkey = l_partkey AND p_size < 5
  AND l_quantity < (SELECT 0.5 * avg(l_quantity) FROM lineitem l2 WHERE l2.l_partkey = p_partkey)

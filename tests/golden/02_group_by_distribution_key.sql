-- groups never span shards when the key is grouped: no merge step
SELECT l_orderkey, count(*) AS items, sum(l_quantity) AS quantity
FROM lineitem GROUP BY l_orderkey HAVING sum(l_quantity) > 250

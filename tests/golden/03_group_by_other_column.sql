-- partial aggregates per shard, final aggregate on the client
SELECT l_returnflag, l_linestatus, sum(l_quantity) AS qty, avg(l_discount) AS disc,
       count(*) AS n, min(l_shipdate) AS first, max(l_tax) AS top
FROM lineitem GROUP BY l_returnflag, l_linestatus ORDER BY l_returnflag, l_linestatus

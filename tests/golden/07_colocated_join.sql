-- lineitem and orders share a co-location group: the join is local
SELECT o_orderpriority, count(*) AS late
FROM orders JOIN lineitem ON l_orderkey = o_orderkey
WHERE l_commitdate < l_receiptdate GROUP BY o_orderpriority ORDER BY o_orderpriority

SELECT l_orderkey, l_linenumber,
       sum(l_quantity) OVER (PARTITION BY l_orderkey ORDER BY l_linenumber) AS running
FROM lineitem WHERE l_orderkey < 100

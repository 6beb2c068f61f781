-- a table without a distribution column: scans and aggregates still push down
SELECT o_orderstatus, count(*) AS n FROM orders_rr GROUP BY o_orderstatus

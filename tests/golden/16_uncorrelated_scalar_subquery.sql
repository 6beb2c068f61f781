-- the subquery is computed first as a stage of its own
SELECT count(*) AS above FROM orders WHERE o_totalprice > (SELECT avg(o_totalprice) FROM orders)

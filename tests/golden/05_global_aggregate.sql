SELECT count(*) AS n, sum(o_totalprice) AS total, avg(o_totalprice) AS mean FROM orders

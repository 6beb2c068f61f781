SELECT n_name, sum(o_totalprice) AS total
FROM orders JOIN customer ON o_custkey = c_custkey JOIN nation ON c_nationkey = n_nationkey
GROUP BY n_name ORDER BY total DESC LIMIT 3

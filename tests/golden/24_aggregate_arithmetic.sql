-- a replaced AVG keeps its own parentheses: x / avg(y) is not x / sum / count
SELECT o_orderstatus, sum(o_totalprice) / avg(o_totalprice) AS orders_equivalent,
       count(*) - avg(o_shippriority) AS shifted
FROM orders GROUP BY o_orderstatus ORDER BY o_orderstatus

SELECT o_orderkey AS k FROM orders WHERE o_totalprice > 450000
UNION ALL SELECT l_orderkey FROM lineitem WHERE l_quantity > 49 AND l_discount = 0.10

SELECT DISTINCT o_orderpriority, o_orderstatus FROM orders

-- filters and projections run on the shards; the client concatenates
SELECT l_orderkey, l_extendedprice * (1 - l_discount) AS revenue
FROM lineitem WHERE l_shipdate < DATE '1992-03-01' AND l_quantity > 45

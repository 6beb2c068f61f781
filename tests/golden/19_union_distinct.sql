SELECT o_custkey AS k FROM orders WHERE o_totalprice > 400000
UNION SELECT c_custkey FROM customer WHERE c_acctbal > 9990

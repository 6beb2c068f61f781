-- median cannot be split into partial and final steps: gather
SELECT o_orderstatus, median(o_totalprice) AS mid FROM orders GROUP BY o_orderstatus

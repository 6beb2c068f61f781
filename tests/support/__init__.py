"""Test-support code: a tolerant result comparator (``oracle``) and a random SQL generator
(``querygen``) for differential testing of shardflow against DuckDB."""

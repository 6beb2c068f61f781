"""Test-support code for shardflow's tests (no Ray needed): among others a tolerant result
comparator (``oracle``) and a random SQL generator (``querygen``) for differential testing
against DuckDB."""

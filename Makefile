# The two commands of the README. Each makes .venv if it is missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench conformance clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardflow demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# DuckDB's sqllogictest corpus (../shared/peer-sql, or $$SHARDFLOW_PEER_SQL) on a real
# 3-worker cluster; fails if any answer is wrong. The full report goes to CONFORMANCE_JSON.
CONFORMANCE_JSON ?= .conformance/report.json
conformance: $(STAMP)
	$(BIN)/python -m tests.conformance --json $(CONFORMANCE_JSON) $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/tpch.py --sf 1 --workers 4

clean:
	rm -rf $(VENV) .shardflow .shardflow-demo .pytest_cache .mypy_cache .ruff_cache .hypothesis \
		.conformance

# The two commands of the README. Each makes .venv if it is missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint browser redis bench conformance clean
CHROMIUM := /usr/bin/chromium

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

# The console and profile-page tests drive Debian's headless Chromium: installed here where
# this user may (root, with apt-get); elsewhere those two tests are skipped, saying how to get
# it (CI sets SHARDFLOW_REQUIRE_BROWSER=1: there they fail instead).
browser:
	@if [ ! -x $(CHROMIUM) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
		|| { apt-get update >/dev/null 2>&1 \
		     && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } \
		|| echo "could not install chromium: the browser tests will be skipped"; \
	fi

# The clusters that survive their head keep its state in Debian's redis-server: installed
# here the same way (CI sets SHARDFLOW_REQUIRE_REDIS=1: without it those tests fail there).
REDIS := /usr/bin/redis-server
redis:
	@if [ ! -x $(REDIS) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's redis-server for the head fault-tolerance tests"; \
		apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 \
		|| { apt-get update >/dev/null 2>&1 \
		     && apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1; } \
		|| echo "could not install redis-server: the head fault-tolerance tests will be skipped"; \
	fi

test: lint browser redis
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

# The two commands of the README. Each makes .venv if it is missing and installs the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint tools bench conformance clean

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

# Some tests need Debian packages beside Python: the console and profile-page tests drive
# headless Chromium, the clusters that survive their head keep its state in redis-server, the
# partition tests cut links with iptables in network namespaces. Installed here where this
# user may (root, with apt-get); elsewhere those tests are skipped, saying how to get them
# (CI sets SHARDFLOW_REQUIRE_BROWSER, _REDIS and _NETNS to 1: there they fail instead).
DEBIAN_TOOLS := /usr/bin/chromium:chromium /usr/bin/redis-server:redis-server \
	/usr/sbin/iptables:iptables /usr/bin/nsenter:util-linux /usr/sbin/ip:iproute2
tools:
	@for pair in $(DEBIAN_TOOLS); do \
		path=$${pair%%:*}; package=$${pair##*:}; \
		if [ ! -x $$path ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's $$package for the tests that need it"; \
			apt-get install -y --no-install-recommends $$package >/dev/null 2>&1 \
			|| { apt-get update >/dev/null 2>&1 \
			     && apt-get install -y --no-install-recommends $$package >/dev/null 2>&1; } \
			|| echo "could not install $$package: the tests that need it will be skipped"; \
		fi; \
	done

test: lint tools
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

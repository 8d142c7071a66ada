# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
# Two test tiers (README, "Development"; tests/tiers.py says what only the second runs):
#   make test       every layer, in CI's budget (.ci/run runs it)
#   make test-all   the whole suite: images, compose on a real engine, every harness, the long fuzz,
#                   the examples' learning tests, the fault matrix, the extras' installs
.PHONY: setup demo test test-all test-fast lint protos

# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
PYTEST = .venv/bin/pytest -ra --durations=30
# `make test` runs its files on TEST_WORKERS pytest-xdist workers (tests/parallel.py says how it shares
# them): two, the CI box's cores; the whole suite runs in one process (its Docker and cluster tests share
# one engine and ports).
TEST_WORKERS ?= 2
NO_TESTS_FAIL = rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/tether demo

test:
	bash scripts/setup.sh --test
	.venv/bin/python scripts/gen_protos.py --check
	$(PYTEST) -m "not full" -n $(TEST_WORKERS); $(NO_TESTS_FAIL)

# TETHER_TEST_TIER=all: a test whose tool setup --test-all installs fails rather than skips without it.
test-all:
	bash scripts/setup.sh --test-all
	.venv/bin/python scripts/gen_protos.py --check
	TETHER_TEST_TIER=all $(PYTEST); $(NO_TESTS_FAIL)

test-fast:
	bash scripts/setup.sh --test
	.venv/bin/pytest -ra -m "not slow and not full" -n $(TEST_WORKERS)

# ruff on the whole tree; mypy on the files [tool.mypy] in pyproject.toml names. mypy keeps its
# incremental cache with the other caches (~/.cache/tether/mypy), where every checkout finds it: a fresh
# clone then checks only what changed (mypy compares each file's hash, not its path or time), ~5 s
# instead of ~65 s. ruff runs while mypy does; both must pass.
MYPY_CACHE_DIR ?= $(HOME)/.cache/tether/mypy
export MYPY_CACHE_DIR

lint: setup
	.venv/bin/mypy & mypy=$$!; \
	.venv/bin/ruff check . && .venv/bin/ruff format --check .; ruff=$$?; \
	wait $$mypy; rc=$$?; [ $$ruff -eq 0 ] && [ $$rc -eq 0 ]

protos:
	.venv/bin/python scripts/gen_protos.py

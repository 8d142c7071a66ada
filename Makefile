# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test test-fast lint protos

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/tether demo

test:
	bash scripts/setup.sh --test
	.venv/bin/python scripts/gen_protos.py --check
	@# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
	.venv/bin/pytest -ra --durations=40; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

test-fast:
	bash scripts/setup.sh --test
	.venv/bin/pytest -ra -m "not slow"

# ruff on the whole tree; mypy on the files [tool.mypy] in pyproject.toml names.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

protos:
	.venv/bin/python scripts/gen_protos.py

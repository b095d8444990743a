# The two commands of the README. Both set everything up from nothing (scripts/bootstrap.sh).
VENV ?= .venv
OUT ?= depthscope-report
PYTEST_ARGS ?=

.PHONY: setup report test test-fast lint bench clean

setup:
	bash scripts/bootstrap.sh

report: setup
	$(VENV)/bin/depthscope run --out $(OUT)

# the README's test command (and CI's, .ci/run): lint, then the whole suite
test: lint
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# the fast tier: everything that does not load the real default model (under a minute)
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache

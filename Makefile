# The two commands of the README. Both set everything up from nothing (scripts/bootstrap.sh).
VENV ?= .venv
OUT ?= depthscope-report
PYTEST_ARGS ?=

.PHONY: setup report test bench clean

setup:
	bash scripts/bootstrap.sh

report: setup
	$(VENV)/bin/depthscope run --out $(OUT)

test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache

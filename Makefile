# The two commands of the README. Both set everything up from nothing (scripts/bootstrap.sh).
VENV ?= .venv
OUT ?= depthscope-report
PYTEST_ARGS ?=
# the suite on a worker per core (at most 4: each holds the 135M model), one torch thread each
# (tests/conftest.py); a module's tests stay on one worker unless conftest.SPLIT_MODULES lets them part
WORKERS ?= -n auto --maxprocesses=4 --dist loadgroup

.PHONY: setup report test test-fast lint check-wheel docs bench clean tunedlens-venv

setup:
	bash scripts/bootstrap.sh

report: setup
	$(VENV)/bin/depthscope run --out $(OUT)

# the README's test command (and CI's, .ci/run): lint, the wheel installed in a fresh venv, then
# the whole suite (the docs build and every code block of README, docs and examples/ included)
test: lint check-wheel
	$(VENV)/bin/python -m pytest -q $(WORKERS) --durations=25 $(PYTEST_ARGS)

# build sdist + wheel, install the wheel (not editable) in a fresh venv, use it from outside the checkout
check-wheel: setup
	bash scripts/check_wheel.sh

# the docs site into site/ (mkdocs serve for a live preview)
docs: setup
	$(VENV)/bin/mkdocs build --strict

# the fast tier: everything that does not load the real default model (about 4 min on 2 quiet cores)
test-fast: setup
	$(VENV)/bin/python -m pytest -q $(WORKERS) -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the environment tests/test_tuned_lens_interop.py runs the tuned-lens package in (the test skips without it)
tunedlens-venv: setup
	PYTHON=$(VENV)/bin/python bash scripts/tunedlens_venv.sh

bench: setup
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache

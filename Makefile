# Two entry points: `make demo` and `make test`. Both create .venv and install on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch. GPU users: install your CUDA torch first, then `pip install -e .[dev]`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

# The oldest declared versions (constraints-floor.txt), in a venv of their own.
FLOOR_VENV ?= .venv-floor
FLOOR_BIN := $(FLOOR_VENV)/bin
FLOOR_STAMP := $(FLOOR_VENV)/.installed
# The suite runs on two pytest-xdist workers (tests/conftest.py gives each its own torchrun port) and
# ends with its 20 slowest tests, to keep an eye on the suite's time.
PYTEST := -m pytest -n $(or $(TEST_WORKERS),2) --durations=20
TEST_ENV := OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: demo test test-floor lint install bench clean trl-tests

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/posttrain demo --output_dir outputs/demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(TEST_ENV) $(BIN)/python $(PYTEST) tests

$(FLOOR_STAMP): pyproject.toml constraints-floor.txt
	test -x $(FLOOR_BIN)/python || $(PY) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/pip install -q --upgrade pip
	$(FLOOR_BIN)/pip install -q -c constraints-floor.txt -e ".[dev]"
	touch $(FLOOR_STAMP)

# The whole suite and the quick demo on the oldest versions pyproject.toml accepts.
test-floor: $(FLOOR_STAMP)
	$(FLOOR_BIN)/python -c "import transformers, accelerate, datasets; print('floor:', 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
	PATH=$(abspath $(FLOOR_BIN)):$$PATH $(TEST_ENV) $(FLOOR_BIN)/python $(PYTEST) tests
	rm -rf outputs/demo-floor
	$(TEST_ENV) $(FLOOR_BIN)/posttrain demo --quick --output_dir outputs/demo-floor

# TRL 0.19.1's own tests of the trainers posttrain replaces, with `trl` renamed (downloads TRL's sdist).
trl-tests: $(STAMP)
	$(TEST_ENV) $(BIN)/python tools/trl_suite.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) outputs build *.egg-info src/*.egg-info

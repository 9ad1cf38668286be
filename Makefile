# Two entry points: `make demo` and `make test`. Both create .venv and install on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch. GPU users: install your CUDA torch first, then `pip install -e .[dev]`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/posttrain demo --output_dir outputs/demo

test: $(STAMP)
	OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
	  $(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) outputs build *.egg-info src/*.egg-info

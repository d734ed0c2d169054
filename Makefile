# README's two commands: `make demo` and `make test`. Each sets up .venv on its own.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; a user's existing torch (in the venv or on the system) is left as it is.
TORCH_PIN ?= torch==2.13.0
# pytest workers: one per core up to this many (each interprets kernels in Triton's CPU interpreter, a test file each)
TEST_JOBS ?= 4

.PHONY: demo test test-all lint docs gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PIN)
	$(PY) -m pip install -e ".[dev,docs]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/kitsune demo

test: $(VENV)/.installed
	$(PY) -m ruff check kitsune tests examples
	$(PY) -m ruff format --check kitsune tests examples
	$(PY) -m pytest -q -n auto --maxprocesses $(TEST_JOBS) --dist loadfile -m "not slow"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# the suite with its long runs too (tests marked `slow`: minutes each in the CPU interpreter; the GPU check runs them)
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses $(TEST_JOBS) --dist loadfile

docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache

# Two commands: `make demo` (install what is missing, then profile -> plan -> summary
# on a built-in example) and `make test` (install what is missing, then run the tests).
# Every target uses $(PYTHON): `make test PYTHON=.venv/bin/python`.
PYTHON ?= python3
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo test test-slow lint bench check-docs

# torch first: if any torch is importable (a GPU user's own build) it is kept; otherwise
# the CPU build is installed, so the project's `torch>=2.1` is satisfied without pulling CUDA.
# Then `pip install -e` only when this tree is not what $(PYTHON) imports or a dependency of
# pyproject.toml (with the dev extra) is missing (tools/installed.py says which).
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_CPU)"
	@$(PYTHON) tools/installed.py || $(PYTHON) -m pip install -q -e ".[dev]"

demo: install
	@PYTHON="$(PYTHON)" bash examples/demo.sh

test: install
	$(PYTHON) -m pytest

test-slow: install
	$(PYTHON) -m pytest -m slow

check-docs: install
	$(PYTHON) tools/check_docs.py

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m mypy partitioner partitioner_cli solvers runtime

# The quick set of benchmarks; `make bench BENCH="dp_scaling fidelity --write"` picks and writes.
BENCH ?=
bench: install
	$(PYTHON) -m partitioner_cli bench $(BENCH)

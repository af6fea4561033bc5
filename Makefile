# Two commands: `make demo` (install what is missing, then profile -> plan -> summary
# on a built-in example) and `make test` (install what is missing, then run the tests).
PYTHON ?= python3
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo test lint bench

# torch first: if any torch is importable (a GPU user's own build) it is kept; otherwise
# the CPU build is installed, so the project's `torch>=2.1` is satisfied without pulling CUDA.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_CPU)"
	@$(PYTHON) -m pip install -q -e ".[dev]"

demo: install
	@bash examples/demo.sh

test: install
	$(PYTHON) -m pytest

lint:
	ruff check . && mypy partitioner solvers

bench: install
	$(PYTHON) bench/dp_scaling.py

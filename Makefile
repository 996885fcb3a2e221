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

# The tests run against the newest releases of transformers / accelerate / peft / trl that
# install in the supported range (the test extras), then the hf_versions subset against the
# lowest supported ones (offload/hf/versions.py): from a venv in $(LOWEST) that holds only those
# releases (and what they need that differs) and sees $(VENV)'s packages behind its own.
LOWEST := $(VENV)/hf-lowest
LPY    := $(LOWEST)/bin/python
LSTAMP := $(LOWEST)/.offload-installed

$(LSTAMP): $(STAMP) offload/hf/versions.py
	rm -rf $(LOWEST)
	$(PY) -m venv --system-site-packages $(LOWEST)
	$(PY) -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_paths()['purelib'])" \
	    > "$$($(LPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/offload-behind.pth"
	$(LPY) -m pip --disable-pip-version-check -q install \
	    $$($(PY) -c "from offload.hf.versions import lowest_requirements as r; print(r())")
	$(LPY) -c "import sys; from offload.hf.versions import not_lowest as n; sys.exit('; '.join(n()) or 0)"
	touch $@

test: setup $(LSTAMP)
	$(PY) -m pytest -q tests
	$(LPY) -m pytest -q -m hf_versions tests/test_hf_*.py

# make train: the job this project is for, in two stages, nothing downloaded (README, "make train").
#  1. pretrain: a fresh small Llama with a byte-level tokenizer (offload new-model), trained briefly
#     on the help topics of Python's pydoc_data (offload finetune, full), saved in Hugging Face layout;
#  2. fine-tune: LoRA on a second local text (standard-library source) through offload finetune,
#     parameters and optimizer state on NVMe; writes the adapter (PEFT layout).
# Each stage is bounded by --max-minutes (the run is still saved). RUN=dir to choose the output.
RUN     := $(or $(RUN),runs/$(shell date +%Y%m%d-%H%M%S))
OFFLOAD := $(PY) -m offload.cli

train: setup
	mkdir -p $(RUN)
	$(OFFLOAD) corpus --pydoc $(RUN)/pretrain.txt --stdlib $(RUN)/finetune.txt
	$(OFFLOAD) new-model $(RUN)/base-init --hidden 128 --layers 4 --heads 4 --max-positions 256
	$(OFFLOAD) finetune $(RUN)/base-init --data $(RUN)/pretrain.txt --out $(RUN)/base \
	    --steps 150 --batch-size 16 --seq-len 128 --lr 3e-3 --warmup 10 --log-steps 5 --offload-optimizer cpu --max-minutes 1.5
	$(OFFLOAD) finetune $(RUN)/base --data $(RUN)/finetune.txt --out $(RUN)/adapter \
	    --lora r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj,up_proj,down_proj \
	    --steps 80 --batch-size 8 --seq-len 128 --lr 5e-3 --warmup 5 --log-steps 5 \
	    --offload-param nvme --offload-optimizer nvme --max-minutes 1

bench: setup
	$(PY) benchmarks/bench_adam.py
	$(PY) benchmarks/bench_io.py

clean:
	rm -rf build $(VENV) offload/_offload_native*.so *.egg-info

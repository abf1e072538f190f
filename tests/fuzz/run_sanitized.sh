#!/usr/bin/env bash
# The loaders' fuzzers against a build of fastckpt._C with AddressSanitizer and
# UBSan (hostile and damaged input).
#
#   tests/fuzz/run_sanitized.sh [EXAMPLES]
#
# EXAMPLES (else $FASTCKPT_FUZZ_EXAMPLES, else 17000) is hypothesis' example
# count per fuzz test: tests/python/torchsave/test_fuzz_load.py and test_fuzz_dcp.py
# have 3 each, so the default runs >= 100,000 inputs. The total actually
# executed is counted where the loaders are called (tests/fuzz/fuzz_plugin.py)
# and the run FAILS unless it reaches $FASTCKPT_FUZZ_MIN_INPUTS (default
# 100000 when EXAMPLES is not given, else 6 x EXAMPLES x 0.95).
#
# Steps, each of which fails the run:
#  1. build fastckpt._C with FASTCKPT_SANITIZE=address,undefined into
#     build/sanitized/ (or $FASTCKPT_SANITIZED_OUT), with a copy of the fastckpt
#     package beside it; the in-tree extension is never touched;
#  2. check the built .so calls into both sanitizers (nm -D);
#  3. canary: a deliberate heap overflow through fastckpt._C must be stopped
#     by ASan (tests/fuzz/asan_canary.py) under the same environment;
#  4. tests/python/core/test_engine.py as a smoke test, then the fuzzers, with the
#     ASan runtime preloaded; fuzz_plugin refuses to run unless fastckpt._C is
#     the sanitized one and libasan is in the process;
#  5. any sanitizer report fails the run, as does a count below the minimum.
#
# PYTEST_ARGS (word-split) go to pytest; node ids there are relative to the
# repository root, e.g.
#   PYTEST_ARGS=--deselect=tests/python/torchsave/test_fuzz_load.py::test_corpus_regressions
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
case "$PY" in /*) ;; *) PY="$REPO/$PY" ;; esac
if [ $# -ge 1 ]; then
    EXAMPLES=$1
    EXPLICIT=1
elif [ -n "${FASTCKPT_FUZZ_EXAMPLES:-}" ]; then
    EXAMPLES=$FASTCKPT_FUZZ_EXAMPLES
    EXPLICIT=1
else
    EXAMPLES=17000
    EXPLICIT=0
fi
case "$EXAMPLES" in ''|*[!0-9]*) echo "run_sanitized.sh: EXAMPLES must be a number (got '$EXAMPLES')" >&2; exit 2 ;; esac
if [ -z "${FASTCKPT_FUZZ_MIN_INPUTS:-}" ]; then
    if [ "$EXPLICIT" = 0 ]; then MIN_INPUTS=100000; else MIN_INPUTS=$((EXAMPLES * 6 * 95 / 100)); fi
else
    MIN_INPUTS=$FASTCKPT_FUZZ_MIN_INPUTS
fi
OUT=${FASTCKPT_SANITIZED_OUT:-$REPO/build/sanitized}
SANITIZE=${FASTCKPT_SANITIZE:-address,undefined}
LOG=${FASTCKPT_FUZZ_LOG:-$OUT/fuzz.log}
REPORT=$OUT/fuzz-report.json

die() { echo "run_sanitized.sh: FAIL: $*" >&2; exit 1; }
say() { echo "run_sanitized.sh: $*"; }

case "$SANITIZE" in *address*) ;; *) die "FASTCKPT_SANITIZE=$SANITIZE: this script needs AddressSanitizer in the list" ;; esac
mkdir -p "$OUT/lib" "$OUT/temp"
OUT=$(cd "$OUT" && pwd)
case "$OUT" in "$REPO"/fastckpt|"$REPO"/fastckpt/*) die "the output directory must not be inside the package" ;; esac
T0=$(date +%s)

# ---- 1. build, out of tree
say "building fastckpt._C with -fsanitize=$SANITIZE into $OUT/lib"
"$PY" - "$REPO/fastckpt" "$OUT/lib/fastckpt" <<'EOF'
import os, shutil, sys
src, dst = sys.argv[1:]
if os.path.isdir(dst):  # a fresh copy of the Python sources; the .so stays for an incremental build
    for entry in os.listdir(dst):
        p = os.path.join(dst, entry)
        if not (entry.startswith("_C.") and entry.endswith(".so")):
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
EOF
(cd "$REPO" && FASTCKPT_SANITIZE="$SANITIZE" "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp") \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log" >&2; die "the sanitized build failed (log: $OUT/build.log)"; }
shopt -s nullglob
SOS=("$OUT"/lib/fastckpt/_C*.so)
[ ${#SOS[@]} -eq 1 ] || die "expected one fastckpt/_C*.so in $OUT/lib, found ${#SOS[@]}"
SO=${SOS[0]}
grep -q -- "-fsanitize=$SANITIZE" "$OUT/temp/build.ninja" || die "$OUT/temp/build.ninja does not compile with -fsanitize=$SANITIZE"

# ---- 2. the extension is instrumented
NASAN=$(nm -D --undefined-only "$SO" | grep -c ' __asan_' || true)
say "$SO references $NASAN __asan_* symbols"
[ "$NASAN" -gt 0 ] || die "$SO is not instrumented by AddressSanitizer"
case "$SANITIZE" in *undefined*)
    NUBSAN=$(nm -D --undefined-only "$SO" | grep -c ' __ubsan_handle_' || true)
    say "$SO references $NUBSAN __ubsan_handle_* symbols"
    [ "$NUBSAN" -gt 0 ] || die "$SO is not instrumented by UBSan" ;;
esac

# ---- the sanitized environment
ASAN_LIB=$(g++ -print-file-name=libasan.so)
[ -f "$ASAN_LIB" ] || die "no libasan.so ($ASAN_LIB); install the compiler's sanitizer runtimes"
PRELOAD=$(readlink -f "$ASAN_LIB")
case "$SANITIZE" in *undefined*)
    UBSAN_LIB=$(g++ -print-file-name=libubsan.so)
    [ -f "$UBSAN_LIB" ] || die "no libubsan.so ($UBSAN_LIB)"
    PRELOAD="$PRELOAD:$(readlink -f "$UBSAN_LIB")" ;;
esac
export LD_PRELOAD="$PRELOAD"
# CPython and torch keep memory until exit by design: no leak check. A huge
# allocation (a size taken from a damaged file) is an error, not a slow run.
# Reports go to files ($SANLOG.<pid>), not to stderr: pytest captures fd 2 while a test
# runs, and a report written there is lost when the sanitizer aborts the process.
SANLOG=$OUT/sanitizer-report
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=0:max_allocation_size_mb=2048:log_path=$SANLOG:${ASAN_EXTRA_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:log_path=$SANLOG"
export PYTHONMALLOC=malloc  # every Python buffer gets ASan redzones (pymalloc arenas have none)
export PYTHONPATH="$OUT/lib:$REPO/tests/fuzz"
export FASTCKPT_SANITIZED_DIR="$OUT/lib"
export FASTCKPT_FUZZ_EXAMPLES="$EXAMPLES"
export FASTCKPT_FUZZ_REPORT="$REPORT"
export PYTHONDONTWRITEBYTECODE=1
cd "$OUT"  # `python -m pytest` puts the working directory first on sys.path: not the repo root

sanitizer_reports() { find "$OUT" -maxdepth 1 -type f -name "$(basename "$SANLOG").*" | sort; }

# ---- 3. canary
rm -f "$SANLOG".[0-9]*
set +e
# (in an inner shell, which reports the abort into the log rather than here)
bash -c '"$@"; exit $?' canary "$PY" "$REPO/tests/fuzz/asan_canary.py" > "$OUT/canary.log" 2>&1
RC=$?
set -e
CANARY_REPORT=$(sanitizer_reports)
if [ "$RC" -eq 0 ] || [ -z "$CANARY_REPORT" ] || ! grep -q "AddressSanitizer: heap-buffer-overflow" $CANARY_REPORT; then
    cat "$OUT/canary.log" $CANARY_REPORT >&2
    die "the deliberate heap overflow was not caught by AddressSanitizer (exit $RC): this setup would not catch a real one"
fi
say "canary: ASan stopped a deliberate overflow through fastckpt._C (exit $RC): $(grep -h -m1 -o 'AddressSanitizer: heap-buffer-overflow.*' $CANARY_REPORT | cut -c1-80)"
grep -q "read_ranges" $CANARY_REPORT || die "the canary's report does not go through fastckpt's read_ranges: $CANARY_REPORT"
rm -f $CANARY_REPORT

# ---- 4. smoke test and fuzzers
rm -f "$REPORT"
say "running test_engine.py and the fuzzers with FASTCKPT_FUZZ_EXAMPLES=$EXAMPLES (log: $LOG)"
set +e
"$PY" -m pytest -q -p no:cacheprovider -p fuzz_plugin \
    "$REPO/tests/python/core/test_engine.py" \
    "$REPO/tests/python/torchsave/test_fuzz_load.py" \
    "$REPO/tests/python/dcp/test_fuzz_dcp.py" \
    ${PYTEST_ARGS:-} > "$LOG" 2>&1
RC=$?
set -e
T1=$(date +%s)
tail -25 "$LOG"

# ---- 5. verdict
REPORTS=$(sanitizer_reports)
if [ -n "$REPORTS" ]; then
    head -60 $REPORTS >&2
    die "a sanitizer reported an error: $REPORTS (log: $LOG)"
fi
if grep -nE "ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:|SUMMARY: (Address|Undefined)Sanitizer" "$LOG" >&2; then
    die "a sanitizer reported an error (log: $LOG)"
fi
[ "$RC" -eq 0 ] || die "pytest exited with $RC (log: $LOG)"
[ -f "$REPORT" ] || die "no report from fuzz_plugin ($REPORT): the plugin did not run"
"$PY" - "$REPORT" "$OUT/lib" "$MIN_INPUTS" "$((T1 - T0))" <<'EOF'
import json, os, sys
report, lib, minimum, wall = sys.argv[1], os.path.realpath(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r = json.load(open(report))
so = r["proof"].get("fastckpt._C", "")
if not so.startswith(lib + os.sep) or not r["proof"].get("asan_runtime") or not r["proof"].get("__asan_init"):
    sys.exit(f"run_sanitized.sh: FAIL: the tests did not run on the sanitized build: {r['proof']}")
total = sum(r["counts"].values())
print(f"run_sanitized.sh: imported {so} with {', '.join(r['proof']['asan_runtime'])}")
print(f"run_sanitized.sh: inputs executed: {total} "
      f"({', '.join(f'{k}: {v}' for k, v in r['counts'].items())}); tests: {r['tests_collected']}, "
      f"failed: {r['tests_failed']}; wall time: {wall} s ({wall / 60:.1f} min)")
if total < minimum:
    sys.exit(f"run_sanitized.sh: FAIL: {total} inputs executed, fewer than the required {minimum}")
print("run_sanitized.sh: OK")
EOF

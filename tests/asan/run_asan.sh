#!/usr/bin/env bash
# Leak and memory-error check of the C core: builds it with AddressSanitizer (LeakSanitizer
# included) in a temporary directory (the argument packer too), runs tests/test_core.py, tests/test_transfers.py,
# tests/test_argpack.py and tests/test_linger.py (or the tests given as arguments) against that build, and reports
# every sanitizer finding that involves the core's own code.  CPython's deliberate leaks at exit are not ours and are left out.
#
#   tests/asan/run_asan.sh                       # from the repository root; 15-60 s
#   tests/asan/run_asan.sh tests/test_core.py    # other tests
#   KEEP=1 tests/asan/run_asan.sh                # keep the build and the raw reports
#
# Needs gcc with libasan (Debian: gcc's libasan8).  Exit status 0: clean; 1: a finding or a failed
# test; 2: the build could not be made.  The installed package is not touched.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$(cd "$ROOT" && python3 -c "import sys; print(sys.executable)")}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/flagcx-mc-asan.XXXXXX")"
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

LIBASAN="$(gcc -print-file-name=libasan.so)"
if [ ! -e "$LIBASAN" ] || [ "$LIBASAN" = libasan.so ]; then
    echo "run_asan: gcc has no libasan (install gcc's AddressSanitizer runtime, e.g. libasan8)" >&2
    exit 2
fi
LIBASAN="$(readlink -f "$LIBASAN")"

# 1. Build the core with the sanitizer, from a copy of the build inputs (cffi compiles in place).
cp -r "$ROOT/_cffi_build" "$ROOT/pyproject.toml" "$WORK/"
echo "run_asan: building the core with -fsanitize=address in $WORK"
if ! (cd "$WORK" && CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" LDFLAGS="-fsanitize=address" \
      "$PYTHON" -c "import sys; sys.path.insert(0, '_cffi_build'); import build_core; build_core.ffibuilder.compile(tmpdir='.')" \
      >"$WORK/build.log" 2>&1); then
    cat "$WORK/build.log" >&2
    echo "run_asan: build failed" >&2
    exit 2
fi

# 2. A copy of the package next to the sanitized module; children of the tests import it too.
mkdir -p "$WORK/site"
(cd "$ROOT" && find flagcx_mc -name '*.py' -o -name 'py.typed') | while read -r f; do
    mkdir -p "$WORK/site/$(dirname "$f")"
    cp "$ROOT/$f" "$WORK/site/$f"
done
cp "$WORK"/flagcx_mc/_fmc_cffi*.so "$WORK/site/flagcx_mc/"
# The argument packer (a plain CPython extension, built against the limited API as setup.py
# builds it), sanitized too.
PYINC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if ! gcc -shared -fPIC -O1 -g -fsanitize=address -fno-omit-frame-pointer -DPy_LIMITED_API=0x030A0000 -I"$PYINC" \
        "$ROOT/_cffi_build/argpack.c" -o "$WORK/site/flagcx_mc/_argpack.abi3.so" >>"$WORK/build.log" 2>&1; then
    cat "$WORK/build.log" >&2
    echo "run_asan: build of the argument packer failed" >&2
    exit 2
fi

# 3. Run the tests with the runtime preloaded (python itself is not instrumented).  First make
#    sure that what they import is the sanitized build.
IMPORTED="$(cd "$WORK/site" && LD_PRELOAD="$LIBASAN" PYTHONPATH="$WORK/site" ASAN_OPTIONS=detect_leaks=0 \
            "$PYTHON" -c 'import flagcx_mc._fmc_cffi as m; print(m.__file__)')"
case "$IMPORTED" in
    "$WORK/site/"*) ;;
    *) echo "run_asan: the tests would import $IMPORTED, not the sanitized build" >&2; exit 2 ;;
esac
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
    TESTS=("$ROOT/tests/test_core.py" "$ROOT/tests/test_transfers.py" "$ROOT/tests/test_argpack.py" "$ROOT/tests/test_linger.py")
else
    for i in "${!TESTS[@]}"; do TESTS[$i]="$(cd "$(dirname "${TESTS[$i]}")" && pwd)/$(basename "${TESTS[$i]}")"; done
fi
mkdir -p "$WORK/reports"
echo "run_asan: running ${TESTS[*]##*/}"
(cd "$WORK/site" && \
 LD_PRELOAD="$LIBASAN" PYTHONPATH="$WORK/site" PYTHONMALLOC=malloc \
 ASAN_OPTIONS="detect_leaks=1:log_path=$WORK/reports/asan:exitcode=86:malloc_context_size=30:detect_stack_use_after_return=0" \
 "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$WORK/junit.xml" "${TESTS[@]}" 2>&1 | tail -n 15)

# 4. Judge: test results from the junit file (the exit status is the sanitizer's), findings from
#    the reports.
"$PYTHON" - "$WORK" <<'PY'
import glob, re, sys, xml.etree.ElementTree as ET

work = sys.argv[1]
status = 0
try:
    suite = ET.parse(f"{work}/junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, failures, errors = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors"))
    print(f"run_asan: {tests} tests, {failures} failed, {errors} errors")
    status |= failures + errors > 0 or tests == 0
except (OSError, ET.ParseError) as exc:
    print(f"run_asan: no test results ({exc}): a sanitizer error probably killed the run")
    status = 1
ours = re.compile(r" in fmc_\w+ |_cffi_build/src/(\w+/)?fmc_\w+\.c|argpack\.c")  # a frame in our own C code
errors, leaks, foreign = [], [], 0
for path in sorted(glob.glob(f"{work}/reports/asan.*")):
    text = open(path, errors="replace").read()
    for block in re.split(r"\n(?==+\n|Direct leak|Indirect leak)", text):
        if "ERROR: AddressSanitizer" in block:
            errors.append(f"{path}:\n{block.strip()}")
        elif block.startswith(("Direct leak", "Indirect leak")):
            if ours.search(block):
                leaks.append(f"{path}:\n{block.strip()}")
            else:
                foreign += 1
for finding in errors + leaks:
    print(finding, "\n")
print(f"run_asan: {len(errors)} memory errors, {len(leaks)} leaks in the core "
      f"({foreign} leak records of CPython and other libraries ignored)")
sys.exit(1 if status or errors or leaks else 0)
PY

#!/usr/bin/env bash
# The whole test suite, from a clean clone: install, build (CUDA included when nvcc exists), run the
# unit/model tests and the Python end-to-end tests, then rebuild with clang + ASan/UBSan and run the
# unit tests and every fuzz target for a bounded time. CI runs exactly this (.ci/run).
#   KESTREL_FUZZ_SECONDS  seconds per fuzz target (default 30)
#   KESTREL_SKIP_ASAN=1   skip the sanitizer pass (local iteration only)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

scripts/install-deps.sh
scripts/build.sh

echo "== unit and model tests (ctest) =="
ctest --test-dir build --output-on-failure -j "$jobs"

echo "== end-to-end tests (pytest) =="
KESTREL_BIN="$PWD/build/src/cli/kestrel" .venv/bin/python -m pytest -q tests/py

if [ "${KESTREL_SKIP_ASAN:-0}" != 1 ]; then
  echo "== ASan+UBSan build, unit tests and fuzz targets =="
  CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKESTREL_SANITIZE=ON \
    -DKESTREL_FUZZ=ON -DKESTREL_CUDA=OFF -DKESTREL_FUZZ_SECONDS="${KESTREL_FUZZ_SECONDS:-30}" \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
  ninja -C build-asan
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs"
fi
echo "all test stages passed"

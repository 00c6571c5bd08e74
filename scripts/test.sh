#!/usr/bin/env bash
# The whole test suite, from a clean clone: install, build (CUDA included when nvcc exists), run the
# unit/model tests and the Python end-to-end tests, then build every libFuzzer target with ASan/UBSan (clang)
# and run each for a bounded time. CI runs exactly this (.ci/run).
#   KESTREL_FUZZ_SECONDS  seconds per fuzz target (default 10; 15 until CI neared its 30 minutes on a slower VM)
#   KESTREL_SKIP_ASAN=1   skip the sanitizer pass (local iteration only)
#   KESTREL_ASAN_UNIT=1   also the unit tests under g++ ASan+UBSan (not in CI: see below)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# Each stage prints the seconds since the start and the CPU time used so far (`times`: this shell, then its
# children, user and system), so CI's log shows where its 30 minutes go.
stage() {
  echo "== $* == (${SECONDS}s; CPU so far:"
  times
  echo ")"
}

stage "install dependencies"
scripts/install-deps.sh
stage "build (release, CUDA when nvcc exists)"
# CI's build: line tables only, -O1 test code and unity translation units (KESTREL_FAST_BUILD and KESTREL_UNITY
# in CMakeLists.txt say why).
KESTREL_CMAKE_ARGS="-DKESTREL_FAST_BUILD=ON ${KESTREL_CMAKE_ARGS:-}" scripts/build.sh

stage "unit and model tests (ctest)"
# -LE emu: the CPU emulation of the KDA kernels takes ~9 min at full size (tests/emu/CMakeLists.txt); its
# smoke case runs here, the rest with `ctest --test-dir build -L emu`.
ctest --test-dir build --output-on-failure -j "$jobs" -LE emu

stage "end-to-end tests (pytest)"
KESTREL_BIN="$PWD/build/src/cli/kestrel" KESTREL_REQUIRE_CHROMIUM=1 .venv/bin/python -m pytest -q --durations=15 tests/py

if [ "${KESTREL_SKIP_ASAN:-0}" != 1 ] && [ "${KESTREL_ASAN_UNIT:-0}" = 1 ]; then
  # The unit tests under g++ ASan+UBSan (clang 14 cannot compile Boost.Asio's C++20 coroutines in src/server and
  # src/benchclient). Opt-in: the instrumented build alone took 30 CPU-minutes (15 of CI's 30 minutes on 2 cores;
  # with it CI took 2,247 s), so CI keeps the sanitizers on the fuzz targets below — every parser of outside
  # input — and a developer runs this pass with KESTREL_ASAN_UNIT=1 before landing memory-sensitive changes.
  stage "ASan+UBSan build (g++)"
  # -O1 with line tables: what the sanitizers' authors recommend for tests (usable speed, exact reports); the
  # unit tests run about twice as fast as at -O0.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" \
    -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DKESTREL_SANITIZE=ON -DKESTREL_CUDA=OFF \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
  # Only what the sanitizer ctest runs (the unit tests and the MPI checks), not the CLI and benchmarks.
  ninja -C build-asan kestrel_unit_tests $(ninja -C build-asan -t targets all 2>/dev/null | grep -o '^kestrel_mpi_[a-z_]*' | sort -u)
  # Left to the release stage above, for CI's 30 minutes: the trained model's 4K-token index-key agreement
  # (6 minutes at -O0 under ASan), the tensor-parallel model runs (whole nano forwards on 2-4 rank threads
  # and under mpirun, ~45 s optimised), k3-tiny's structured-output runs and the JSON-Schema-Test-Suite
  # sweeps and adversarial schemas (40–60 s each at -O0); they run the same model, MLA, indexer, collective
  # and constraint code as the nano, TensorParallelErrors and other Structured tests here, and the
  # constraint compiler's input is fuzzed below. Likewise the longest of the rest under ASan (18–31 s each:
  # the 10,000-step scheduler simulation, the structured preemption run, the mixed-batch engine loop, the
  # adversarial schemas, the mpirun engine), whose code the shorter tests here cover.
  stage "ASan+UBSan unit tests"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" \
      -E 'TrainedModelIndexAgreementAtLongContext|TensorParallel\.|TensorParallelServing\.|mpi_tp|mpi_generate|K3TinyStructured|StructuredSuite\.|EngineStructured\.SuiteSchemas|EngineStructured\.PreemptionAndPrefixCache|ServerStructured\.AdversarialSchemas|StructuredSchema\.Adversarial|SchedSimulation\.TenThousandStepsThreeSeeds|EngineLoop\.MixedBatch'
fi

if [ "${KESTREL_SKIP_ASAN:-0}" != 1 ]; then
  # The fuzz targets under clang, which alone has libFuzzer.
  stage "libFuzzer build (clang, ASan+UBSan)"
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKESTREL_SANITIZE=ON \
    -DKESTREL_FUZZ=ON -DKESTREL_TESTS=OFF -DKESTREL_CUDA=OFF -DKESTREL_UNITY=ON -DKESTREL_FUZZ_SECONDS="${KESTREL_FUZZ_SECONDS:-10}" \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
  ninja -C build-fuzz $(cd tests/fuzz && ls fuzz_*.cpp | sed 's/\.cpp$//')
  stage "libFuzzer runs"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-fuzz --output-on-failure -j "$jobs"
fi
echo "all test stages passed (${SECONDS}s)"

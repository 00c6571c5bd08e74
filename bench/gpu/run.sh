#!/usr/bin/env bash
# GPU tests (and, later, benchmarks) on the H200 machine.
#
# The GPU machine has CUDA, CMake and ninja but none of our Debian -dev packages and no network,
# so the binaries are built here (same x86-64, -arch sm_90a) and carried there with the one shared
# library the image lacks (libfmt). Two steps:
#   bench/gpu/run.sh pack    # here: build, copy binaries + libfmt into .gpu-carry/ (git-ignored)
#   bench/gpu/run.sh test    # there: run every GPU test binary from .gpu-carry/
# With the device tool: run `bench/gpu/run.sh test` with carry [".gpu-carry"].
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  pack)
    scripts/build.sh >/dev/null
    grep -qx "/.gpu-carry/" .git/info/exclude 2>/dev/null || echo "/.gpu-carry/" >> .git/info/exclude
    rm -rf .gpu-carry && mkdir -p .gpu-carry/lib
    cp build/tests/gpu/kestrel_gpu_tests build/src/cli/kestrel .gpu-carry/
    cp -L "$(ldconfig -p | awk '/libfmt.so.9 /{print $NF; exit}')" .gpu-carry/lib/
    du -sh .gpu-carry
    ;;
  test)
    export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    .gpu-carry/kestrel_gpu_tests
    ;;
  *)
    echo "usage: $0 pack|test" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Configures and builds kestrel in build/ (release with debug info). CUDA sources are compiled when
# nvcc is on PATH or in /usr/local/cuda/bin. Arguments are ninja targets (default: everything), e.g.
# `scripts/build.sh kestrel` builds the binary alone. KESTREL_CMAKE_ARGS adds configure options
# (scripts/test.sh passes -DKESTREL_FAST_BUILD=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$PWD/.venv/bin/python" \
  ${KESTREL_CMAKE_ARGS:-} >/dev/null
ninja -C build "$@"

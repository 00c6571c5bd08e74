#!/usr/bin/env bash
# Installs what kestrel needs on a Debian machine (12 "bookworm" or newer) and prepares .venv with
# the Python test tools. Idempotent and quick when everything is present: apt-get runs only for
# packages that are missing. The CUDA toolkit is optional: CUDA sources build whenever nvcc exists.
# OpenMPI runs the multi-process CPU twin and launches multi-GPU ranks (docs/parallel.md). NCCL is
# optional: its header comes with the CUDA toolkit when the toolkit carries it (CUDA 13.0 here does),
# and libnccl.so.2 is loaded at run time only by multi-GPU runs.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev
      nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libgmock-dev
      libicu-dev libopenblas-dev libboost-dev json-schema-test-suite
      libopenmpi-dev openmpi-bin
      python3 python3-venv python3-pip chromium)
# chromium: the chat page's browser test (tests/py/test_chat_page.py, headless). Like every package here it is
# installed only when missing, so it costs CI nothing where the image already has it.
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, safetensors, pytest" 2>/dev/null || \
   ! cmp -s reference/requirements.txt .venv/.requirements 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r reference/requirements.txt
  cp reference/requirements.txt .venv/.requirements
fi

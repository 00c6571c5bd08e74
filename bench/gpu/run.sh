#!/usr/bin/env bash
# GPU tests (and, later, benchmarks) on the H200 machine.
#
# The GPU machine has CUDA, CMake and ninja but none of our Debian -dev packages and no network,
# so the binaries are built here (same x86-64, -arch sm_90a) and carried there, stripped of debug
# info, with the shared libraries the image lacks (libfmt; OpenBLAS, libgomp and OpenBLAS's Fortran
# runtime, which the GPU tests need because they link the CPU twins; ICU, which the runtime's tokenizer
# links, so `kestrel` itself runs there too), gzipped into .gpu-carry/libs.tgz and unpacked on first
# use. cuBLASLt comes from the image's CUDA toolkit. Two steps:
#   bench/gpu/run.sh pack    # here: build, copy binaries + libfmt into .gpu-carry/ (git-ignored)
#   bench/gpu/run.sh test    # there: run every GPU test binary from .gpu-carry/
#   bench/gpu/run.sh all     # there: make the nano and reduced-mini checkpoints (reference/make_checkpoint.py),
#                            # run the op tests + the GPU-vs-CPU model test on them, then bench_ops
#                            # (logs to $OUT when set)
#   bench/gpu/run.sh serving # there: nano + reduced-mini checkpoints, the GPU serving tests (row copies,
#                            # sampler, engine vs solo vs CPU, CUDA graphs) and the model test, then the
#                            # batch-1/64 decode step of mini split by op (bench_ops --only model)
# With the device tool: run `bench/gpu/run.sh test` with carry [".gpu-carry"].
# The device tool sends the session's main checkout, not a helper's worktree: from a worktree, copy
# .gpu-carry/ and bench/gpu/run.sh into a git-ignored folder F of that checkout (F/.gpu-carry,
# F/bench/gpu/run.sh, and reference/ for `all`/`serving`), carry [F] and run `bash F/bench/gpu/run.sh test`.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # "$0" again after the cd below
cd "$(dirname "$0")/../.."
case "${1:-}" in
  pack)
    # An existing build/ (configured as the developer likes) is reused; otherwise configure one.
    if [ -f build/build.ninja ]; then ninja -C build >/dev/null; else scripts/build.sh >/dev/null; fi
    excl="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree
    grep -qx "/.gpu-carry/" "$excl" 2>/dev/null || echo "/.gpu-carry/" >> "$excl"
    rm -rf .gpu-carry && mkdir -p .gpu-carry/lib
    for b in build/tests/gpu/kestrel_gpu_tests build/src/cli/kestrel build/bench/bench_ops; do
      objcopy --strip-debug "$b" ".gpu-carry/$(basename "$b")"
    done
    for l in libfmt.so.9 libopenblas.so.0 libgomp.so.1 libgfortran.so.5 libquadmath.so.0 libicuuc.so.72 libicudata.so.72; do
      cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" .gpu-carry/lib/
    done
    # ICU (the runtime links the tokenizer) pushes the libraries past the 64 MiB carry: ship them gzipped.
    tar czf .gpu-carry/libs.tgz -C .gpu-carry lib && rm -rf .gpu-carry/lib
    du -sh .gpu-carry
    ;;
  test)
    [ -d .gpu-carry/lib ] || tar xzf .gpu-carry/libs.tgz -C .gpu-carry
    export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    if ! ldd .gpu-carry/kestrel_gpu_tests | grep -q "libcublasLt.so.13 => /"; then
      # Fall back to the pip wheel's copy (nvidia-cublas) if the toolkit's is not on the path.
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    ldd .gpu-carry/kestrel_gpu_tests | grep -E "not found|cublasLt|openblas" || true
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" .gpu-carry/kestrel_gpu_tests "${@:2}"
    ;;
  all)
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null &
    python3 reference/make_checkpoint.py --config mini --out "$ck/mini" --seed 1 --fast-experts --no-vision \
      --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 >/dev/null &
    # Variants with every expert selected (router top-k = all: no discrete routing choice left).
    python3 reference/make_checkpoint.py --config nano --out "$ck/nano_kall" --seed 1 --no-vision \
      --override num_experts_per_token=16 >/dev/null &
    python3 reference/make_checkpoint.py --config mini --out "$ck/mini_kall" --seed 1 --fast-experts --no-vision \
      --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 \
      --override num_experts_per_token=4 >/dev/null &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/nano_kall:$ck/mini:$ck/mini_kall"
    "$self" test --gtest_brief=1 2>&1 | tee "$out/gpu_tests.log" | tail -60 || true
    "$self" bench ${BENCH_ARGS:-} --model "$ck/mini" 2>&1 | tee "$out/bench_ops.md"
    ;;
  serving)
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null &
    [ -f "$ck/mini/config.json" ] || python3 reference/make_checkpoint.py --config mini --out "$ck/mini" --seed 1 --fast-experts --no-vision \
      --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 >/dev/null &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/mini"
    "$self" test --gtest_filter='GpuServingOps.*:GpuSampling.*:GpuEngine.*:GpuGraphs.*:GpuModel.*' 2>&1 \
      | tee "$out/gpu_serving_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -80 || true
    "$self" bench --model "$ck/mini" --only model 2>&1 | tee "$out/decode_step.md"
    ;;
  bench)
    [ -d .gpu-carry/lib ] || tar xzf .gpu-carry/libs.tgz -C .gpu-carry
    export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
    if ! ldd .gpu-carry/bench_ops | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    .gpu-carry/bench_ops "${@:2}"
    ;;
  *)
    echo "usage: $0 pack|test|all|serving|bench" >&2
    exit 2
    ;;
esac

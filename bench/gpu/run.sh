#!/usr/bin/env bash
# GPU tests (and, later, benchmarks) on the H200 machine.
#
# The GPU machine has CUDA, CMake and ninja but none of our Debian -dev packages and no network,
# so the binaries are built here (same x86-64, -arch sm_90a) and carried there, stripped of debug
# info, with the shared libraries the image lacks (libfmt; OpenBLAS, libgomp and OpenBLAS's Fortran
# runtime, which the GPU tests need because they link the CPU twins; ICU, which the runtime's tokenizer
# links, so `kestrel` itself runs there too), packed with them into .gpu-carry/pkg.tar.xz and unpacked on
# first use. cuBLASLt comes from the image's CUDA toolkit. Two steps:
#   bench/gpu/run.sh pack    # here: build, copy binaries + libfmt into .gpu-carry/ (git-ignored)
#   bench/gpu/run.sh test    # there: run every GPU test binary from .gpu-carry/
#   bench/gpu/run.sh bench_mla [--quick] [--only decode,prefill]
#                            # there: bench/gpu/bench_mla.cpp (paged MLA decode/prefill, tensor cores vs baselines)
#   bench/gpu/run.sh all     # there: make the nano and reduced-mini checkpoints (reference/make_checkpoint.py),
#                            # run the op tests + the GPU-vs-CPU model test on them, then bench_ops
#                            # (logs to $OUT when set)
#   bench/gpu/run.sh serving # there: nano + reduced-mini checkpoints, the GPU serving tests (row copies,
#                            # sampler, engine vs solo vs CPU, CUDA graphs) and the model test, then the
#                            # batch-1/64 decode step of mini split by op (bench_ops --only model)
#   bench/gpu/run.sh perf    # there: the scoreboard in one run (≤ 8 min): ceilings, kernels, the reduced-mini
#                            # decode step and prefill, `kestrel serve` + `kestrel bench` at c=1/64, the peers;
#                            # writes $OUT/perf.json (copy it to bench/gpu/perf.json) and a markdown table
#   bench/gpu/run.sh structured
#                            # there: nano checkpoint, the GPU structured-output tests (GpuStructured.*), then
#                            # bench_structured_engine on models/k3-tiny --device cuda at batch 1 and 64
#   bench/gpu/run.sh decode  # there: the fused decode path's tests and bench_ops --perf per variant (see below)
#   bench/gpu/run.sh eval SETS_DIR [MODEL]
#                            # there: `kestrel serve --device cuda` on MODEL (default models/k3-tiny) and
#                            # `kestrel eval` over every SETS_DIR/*.jsonl, smallest first, while
#                            # reference/eval_ref.py answers the same sets on the GPU (PyTorch) for
#                            # `kestrel eval --score-responses`; results per set in $OUT. EVAL_DEADLINE
#                            # (seconds, default 540) stops both before the device tool's limit; a set cut
#                            # off leaves no file. EVAL_REF_SETS (a pattern, default all) picks the
#                            # reference's sets ("none": no reference run); EVAL_SERVE_ARGS adds serve
#                            # flags (e.g. "--index-cache-dtype fp8"), EVAL_PORT moves the port (18123).
# With the device tool: run `bench/gpu/run.sh test` with carry [".gpu-carry"].
# The device tool sends the session's main checkout, not a helper's worktree: from a worktree, copy
# .gpu-carry/ and bench/gpu/run.sh into a git-ignored folder F of that checkout (F/.gpu-carry,
# F/bench/gpu/run.sh, and reference/ for `all`/`serving`), carry [F] and run `bash F/bench/gpu/run.sh test`.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # "$0" again after the cd below
cd "$(dirname "$0")/../.."

# Unpacks .gpu-carry/pkg.tar.xz (binaries and lib/) into .gpu-carry/ once; puts lib/ on the loader path.
unpack() {
  [ -x .gpu-carry/kestrel ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
    .gpu-carry/pkg.tar.xz .gpu-carry
  if [ -d .gpu-carry/pkg ]; then mv .gpu-carry/pkg/* .gpu-carry/ && rmdir .gpu-carry/pkg; fi
  export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
}

case "${1:-}" in
  pack)
    # An existing build/ (configured as the developer likes) is reused; otherwise configure one.
    if [ -f build/build.ninja ]; then ninja -C build >/dev/null; else scripts/build.sh >/dev/null; fi
    excl="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree
    grep -qx "/.gpu-carry/" "$excl" 2>/dev/null || echo "/.gpu-carry/" >> "$excl"
    rm -rf .gpu-carry && mkdir -p .gpu-carry/pkg/lib
    for b in build/tests/gpu/kestrel_gpu_tests build/src/cli/kestrel build/bench/bench_ops; do
      objcopy --strip-debug "$b" ".gpu-carry/pkg/$(basename "$b")"
    done
    for b in build/bench/bench_moe build/bench/bench_mla build/bench/bench_kda build/bench/bench_indexer build/bench/bench_structured_engine; do  # per-kernel benchmarks, when built
      [ -x "$b" ] && objcopy --strip-debug "$b" ".gpu-carry/pkg/$(basename "$b")"
    done
    git rev-parse --short HEAD > .gpu-carry/pkg/COMMIT
    for l in libfmt.so.9 libopenblas.so.0 libgomp.so.1 libgfortran.so.5 libquadmath.so.0 libicuuc.so.72 libicudata.so.72; do
      cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" .gpu-carry/pkg/lib/
    done
    # Binaries + ICU + OpenBLAS are ~95 MB and the tree (with models/k3-tiny) ~36 MB, against the device
    # tool's 64 MiB: one xz archive (~18 MB) keeps room for eval sets; unpacked there by Python's lzma.
    tar cJf .gpu-carry/pkg.tar.xz -C .gpu-carry pkg && rm -rf .gpu-carry/pkg
    du -sh .gpu-carry
    ;;
  test)
    unpack
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
  structured)
    # Structured outputs (issue #20): the GPU tests (token-mask kernel vs its twin, masked sampling, constrained
    # requests through the GPU engine) on nano, then the mask's cost per decode step on k3-tiny at batch 1 and 64.
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null
    export KESTREL_GPU_CKPTS="$ck/nano"
    "$self" test --gtest_filter='GpuStructured.*' 2>&1 | tee "$out/gpu_structured_tests.log" | tail -30 || true
    unpack
    if ! ldd .gpu-carry/bench_structured_engine | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    .gpu-carry/bench_structured_engine --model models/k3-tiny --device cuda --batch 1,64 --tokens 64 2>&1 \
      | tee "$out/structured_engine_cuda.md"
    ;;
  decode)
    # The fused decode path (issue #14 points 2–3) in one call: nano + reduced-mini checkpoints; the decode-path
    # GPU tests (skinny GEMM, PTPC FP8 kernels, AttnRes step, fused KDA chain; whole-step graphs bit-identical to
    # eager; model and engine vs the CPU; FP8 logits vs BF16 on the golden prompts incl. k3-tiny); then
    # bench_ops --perf on the reduced mini: default, ptpc-fp8, and one run per switch turned off
    # (KESTREL_PDL / FUSE / GRAPH_ATTN / SKINNY = 0), so one log shows which change helped.
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null &
    [ -f "$ck/mini/config.json" ] || python3 reference/make_checkpoint.py --config mini --out "$ck/mini" --seed 1 --fast-experts --no-vision \
      --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 >/dev/null &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/mini"
    "$self" test --gtest_filter="${DECODE_TESTS:-GpuDecode.*:GpuFp8.*:GpuGraphs.*:GpuEngine.*:GpuModel.*:GpuOps.*}" 2>&1 \
      | tee "$out/decode_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -90 || true
    : > "$out/decode_bench.md"
    for v in "" KESTREL_PDL=0 KESTREL_FUSE=0 KESTREL_GRAPH_ATTN=0 KESTREL_SKINNY=0; do
      echo "### variant: ${v:-default (all on)}" | tee -a "$out/decode_bench.md"
      env $v "$self" bench --perf --only model --model "$ck/mini" 2>&1 | tee -a "$out/decode_bench.md" \
        | grep -E "^PERF|floor|tokens/s" || true
    done
    echo "### variant: ptpc-fp8" | tee -a "$out/decode_bench.md"
    "$self" bench --perf --quantization ptpc-fp8 --model "$ck/mini" 2>&1 | tee -a "$out/decode_bench.md" \
      | grep -E "^PERF|floor|tokens/s" || true
    ;;
  eval)
    out="${OUT:-/tmp}"
    sets="${2:?usage: run.sh eval SETS_DIR [MODEL]}"
    model="${3:-models/k3-tiny}"
    end=$(( $(date +%s) + ${EVAL_DEADLINE:-540} ))
    left() { echo $(( end - $(date +%s) > 1 ? end - $(date +%s) : 1 )); }
    unpack
    kestrel="${KESTREL_BIN:-.gpu-carry/kestrel}"
    port="${EVAL_PORT:-18123}"
    # shellcheck disable=SC2086  # EVAL_SERVE_ARGS: extra serve flags, e.g. "--index-cache-dtype fp8"
    "$kestrel" serve --device "${EVAL_DEVICE:-cuda}" --model "$model" --port "$port" --max-num-seqs 8 \
      --max-model-len "${EVAL_MAX_LEN:-133120}" --memory-budget "${EVAL_MEMORY:-4G}" ${EVAL_SERVE_ARGS:-} \
      >"$out/serve.log" 2>&1 &
    srv=$!
    trap 'kill $srv 2>/dev/null || true' EXIT
    for _ in $(seq 240); do
      python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
        2>/dev/null && break
      kill -0 $srv 2>/dev/null || { tail -20 "$out/serve.log"; exit 1; }
      sleep 0.5
    done
    mapfile -t files < <(ls "$sets"/*.jsonl | sort -V)
    (
      for f in "${files[@]}"; do
        b="$(basename "$f" .jsonl)"
        timeout "$(left)" "$kestrel" eval --set "$f" --base-url "http://127.0.0.1:$port" --concurrency 8 --no-progress \
          --save-responses --out "$out/engine-$b.json.part" >"$out/engine-$b.txt" 2>&1 \
          && mv "$out/engine-$b.json.part" "$out/engine-$b.json" || { echo "engine: $b cut off or failed"; break; }
        echo "engine: $b done at $(( $(date +%s) - end + ${EVAL_DEADLINE:-540} )) s"
      done
    ) &
    eng=$!
    (
      for f in "${files[@]}"; do
        b="$(basename "$f" .jsonl)"
        case "$b" in ${EVAL_REF_SETS:-*}) ;; *) continue ;; esac
        timeout "$(left)" python3 reference/eval_ref.py --model "$model" --set "$f" --device "${EVAL_REF_DEVICE:-cuda}" \
          --out "$out/ref-$b.json.part" 2>"$out/ref-$b.log" \
          && mv "$out/ref-$b.json.part" "$out/ref-$b.json" || { echo "reference: $b cut off or failed"; break; }
        echo "reference: $b done at $(( $(date +%s) - end + ${EVAL_DEADLINE:-540} )) s"
      done
    ) &
    ref=$!
    wait $eng $ref
    for f in "$out"/engine-*.txt; do tail -n +1 "$f" | grep -vE "^\s*$" | tail -8; done
    grep -hE "^(kestrel|error)" "$out/serve.log" | head -5 || true
    ;;
  perf)
    # The scoreboard: every number of bench/gpu/perf.json measured in this one run (ceilings, our kernels, the
    # engine through `kestrel serve`, and the peers), then perf.py writes perf.json + a markdown table.
    # PERF_DEADLINE (s, default 540) bounds the run inside the device tool's limit; a section cut off is
    # reported missing. Peers: PyTorch grouped matmul (always), FLA (when its wheels are carried in .whl/).
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    end=$(( $(date +%s) + ${PERF_DEADLINE:-540} ))
    left() { echo $(( end - $(date +%s) > 5 ? end - $(date +%s) : 5 )); }
    unpack
    if ! ldd .gpu-carry/bench_ops | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    mkdir -p "$ck" "$out/perf"
    [ -f "$ck/mini/config.json" ] || python3 reference/make_checkpoint.py --config mini --out "$ck/mini" --seed 1 \
      --fast-experts --no-vision --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 \
      >/dev/null &
    ckpt_pid=$!
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/perf/machine.txt"
    # Kernels at the real per-rank shapes (each prints PERF lines; the ceilings come first, from bench_ops).
    timeout "$(left)" .gpu-carry/bench_ops --perf --only ceilings,paged_indexer 2>&1 | tee "$out/perf/ops.log" | grep PERF || true
    for b in bench_moe bench_mla bench_kda bench_indexer; do
      [ -x ".gpu-carry/$b" ] && { timeout "$(left)" ".gpu-carry/$b" --perf 2>&1 | tee "$out/perf/$b.log" | grep PERF || true; }
    done
    timeout "$(left)" python3 bench/gpu/moe_peer.py --perf 2>&1 | tee "$out/perf/moe_peer.log" | grep PERF || true
    python3 -c "import fla" 2>/dev/null && { timeout "$(left)" python3 bench/gpu/kda_peer.py --perf 2>&1 \
      | tee "$out/perf/kda_peer.log" | grep PERF || true; }
    wait "$ckpt_pid"
    # The engine: one decode step and an 8K prefill of the reduced mini, then serving through kestrel serve.
    timeout "$(left)" .gpu-carry/bench_ops --perf --only model --model "$ck/mini" 2>&1 | tee "$out/perf/model.log" | grep PERF || true
    port=18124
    .gpu-carry/kestrel serve --device cuda --model "$ck/mini" --port "$port" --max-num-seqs 64 \
      --gpu-memory-utilization 0.5 >"$out/perf/serve.log" 2>&1 &
    srv=$!
    for _ in $(seq 240); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
      kill -0 $srv 2>/dev/null || break
      sleep 0.5
    done
    for c in 1 64; do
      n=$(( c == 1 ? 16 : 192 ))
      timeout "$(left)" .gpu-carry/kestrel bench --base-url "http://127.0.0.1:$port" --tokenizer "$ck/mini" \
        --input-len 1024 --output-len 128 --ignore-eos --num-prompts "$n" --max-concurrency "$c" --num-warmups 2 \
        --no-progress --result-file "$out/perf/serve_c$c.json" >"$out/perf/serve_bench_c$c.log" 2>&1 || true
    done
    kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    # One million tokens: k3-tiny answers pass keys at 1,048,576 tokens of context (issue #15), when the set
    # (train/k3data/make_eval.py --min-context 1048576 --max-context 1048576, xz-compressed) is carried.
    pk="${PASSKEY_SET:-sets1m/passkey-1m.jsonl.xz}"
    if [ -f "$pk" ]; then
      port=18125
      .gpu-carry/kestrel serve --device cuda --model models/k3-tiny --port "$port" --max-num-seqs 4 \
        --max-model-len 1056768 --memory-budget 8G >"$out/perf/serve_1m.log" 2>&1 &
      srv=$!
      for _ in $(seq 240); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
        kill -0 $srv 2>/dev/null || break
        sleep 0.5
      done
      timeout "$(left)" python3 bench/gpu/passkey_long.py --base-url "http://127.0.0.1:$port" --set "$pk" 2>&1 \
        | tee "$out/perf/passkey_1m.log" || true
      kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    fi
    python3 bench/gpu/perf.py --logs "$out/perf" --out "$out/perf.json" --commit "$(cat .gpu-carry/COMMIT 2>/dev/null)" \
      --machine "$(cat "$out/perf/machine.txt")" \
      --serve "serve_mini_c1=$out/perf/serve_c1.json" "serve_mini_c64=$out/perf/serve_c64.json" | tee "$out/perf.md"
    # The device tool brings back at most 8 files: the logs travel as one archive.
    tar czf "$out/perf_logs.tgz" -C "$out" perf && rm -rf "$out/perf"
    ;;
  bench)
    unpack
    if ! ldd .gpu-carry/bench_ops | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    .gpu-carry/bench_ops "${@:2}"
    ;;
  bench_mla)
    # MLA attention over paged caches: tensor-core decode/prefill vs the CUDA-core and naive baselines.
    unpack
    if ! ldd .gpu-carry/bench_mla | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    .gpu-carry/bench_mla "${@:2}"
    ;;
  *)
    echo "usage: $0 pack|test|all|serving|decode|eval|perf|bench|bench_mla" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# GPU tests (and, later, benchmarks) on the H200 machine.
#
# The GPU machine has CUDA, CMake and ninja but none of our Debian -dev packages and no network,
# so the binaries are built here (same x86-64, -arch sm_90a) and carried there, stripped of debug
# info, with the shared libraries the image lacks (libfmt; OpenBLAS, libgomp and OpenBLAS's Fortran
# runtime, which the GPU tests need because they link the CPU twins; ICU, which the runtime's tokenizer
# links, so `kestrel` itself runs there too), packed with them into .gpu-carry/pkg.tar.xz and unpacked on
# first use. cuBLASLt comes from the image's CUDA toolkit. Two steps:
#   bench/gpu/run.sh pack    # here: build, copy binaries + libfmt into .gpu-carry/ (git-ignored; PACK_SKIP below)
#   bench/gpu/run.sh test    # there: run every GPU test binary from .gpu-carry/
#   bench/gpu/run.sh bench_mla [--quick] [--only decode,prefill]
#                            # there: bench/gpu/bench_mla.cpp (paged MLA decode/prefill, tensor cores vs baselines)
#   bench/gpu/run.sh all     # there: make the nano and reduced-mini checkpoints (reference/make_checkpoint.py),
#                            # run the op tests + the GPU-vs-CPU model test on them, then bench_ops
#                            # (logs to $OUT when set)
#   bench/gpu/run.sh serving # there: nano + reduced-mini checkpoints, the GPU serving tests (row copies,
#                            # sampler, engine vs solo vs CPU, CUDA graphs) and the model test, then the
#                            # batch-1/64 decode step of mini split by op (bench_ops --only model)
#   bench/gpu/run.sh profile # there: Nsight Compute's per-kernel times of one batch-1 decode step of the
#                            # reduced mini (bench/gpu/ncu_step.py turns the CSV into a table)
#   bench/gpu/run.sh timeline [BENCH_OPS ARGS]
#                            # there: bench_ops --perf --only model on the reduced mini with the CUPTI kernel
#                            # tracer injected (bench/gpu/kernel_trace.cpp), then bench/gpu/timeline.py: per graph
#                            # replay, each kernel's start, gap / overlap and exposed time (what PDL hides and what it
#                            # does not); $OUT/timeline.md, $OUT/trace.csv.xz. The tracer slows the host side (the
#                            # traced step graph measured 675 against 595 µs), not the kernels' own spans
#   bench/gpu/run.sh timeline_ab ROUNDS SETTING...
#                            # there: the same under each setting (VAR=VALUE words, "" = as is), alternated, then
#                            # each kernel's exposed time per setting side by side ($OUT/timeline_ab.md)
#   bench/gpu/run.sh perf    # there: the scoreboard in one run (≤ 8 min): ceilings, kernels, the reduced-mini
#                            # decode step and prefill, `kestrel serve` + `kestrel bench` at c=1/64, the peers;
#                            # writes $OUT/perf.json (copy it to bench/gpu/perf.json) and a markdown table
#   bench/gpu/run.sh extras  # here: what perf carries beside .gpu-carry (both git-ignored, remade from public
#                            # sources): .whl/ (PyPI fla-core 0.6.0, the KDA peer) and sets1m/ (the 1M-token
#                            # passkey set); carry [".gpu-carry", ".whl", "sets1m"] with models/k3-tiny-long
#   bench/gpu/run.sh tp      # there: nano + nano_tp_gpu checkpoints, the GPU tensor-parallel tests (GpuTp.*: the
#                            # same-device communicator, the engine as TP2/TP4 and EP2/EP4 on one GPU against TP1;
#                            # GpuMoe.ExpertParallel*: one EP rank's experts against the CPU twin)
#   bench/gpu/run.sh vision  # there: the nano checkpoint with its vision tower (nano_vl), GpuVision.* (the encoder vs
#                            # the CPU encoder) and GpuEngineVision.* (the GPU engine with images vs the CPU engine),
#                            # then bench_ops --perf --only vision (encoder time per 1024² image); needs reference/
#   bench/gpu/run.sh structured
#                            # there: nano checkpoint, the GPU structured-output tests (GpuStructured.*), then
#                            # bench_structured_engine on models/k3-tiny --device cuda at batch 1 and 64 (SUMMARY
#                            # lines: the constrained step's overhead, median of 5 reps; mask pool auto, then 1), and with
#                            # K3TINY_REQUESTS=N (kestrel_unit_tests packed: PACK_EXTRA) N strict-schema requests
#                            # of K3TinyStructured.* on the GPU engine
#   bench/gpu/run.sh spec    # there: DSpark speculation (issue #19): nano + its random draft (make_draft.py), GpuSpec.*,
#                            # then k3-tiny served with and without models/k3-tiny-dspark, `kestrel bench` c = 1 / 16
#   bench/gpu/run.sh decode  # there: the fused decode path's tests and bench_ops --perf per variant (see below)
#   bench/gpu/run.sh kda     # there: KDA (issue #15 point 4): the KDA GPU tests over every kernel variant,
#                            # bench_kda --perf (scoreboard lines + one PERF line per variant), FLA's kda_peer
#                            # --perf (wheel in .whl/), the GPU-vs-CPU model test under each kda_chunked
#                            # variant (KESTREL_KDA_CHUNKED), then the bench_kda tables; logs in $OUT
#   bench/gpu/run.sh bench_kda [--quick] [--only prefill|decode] [--perf [--variant I,S,F]]
#                            # there: bench/gpu/bench_kda.cpp alone
#   bench/gpu/run.sh eval SETS_DIR [MODEL]
#                            # there: `kestrel serve --device cuda` on MODEL (default models/k3-tiny) and
#                            # `kestrel eval` over every SETS_DIR/*.jsonl, smallest first, while
#                            # reference/eval_ref.py answers the same sets on the GPU (PyTorch) for
#                            # `kestrel eval --score-responses`; results per set in $OUT. EVAL_DEADLINE
#                            # (seconds, default 540) stops both before the device tool's limit; a set cut
#                            # off leaves no file. EVAL_REF_SETS (a pattern, default all) picks the
#                            # reference's sets ("none": no reference run); EVAL_SERVE_ARGS adds serve
#                            # flags (e.g. "--index-cache-dtype fp8"), EVAL_PORT moves the port (18123).
#   bench/gpu/run.sh train_long
#                            # there: k3-tiny's long-context stage (bench/gpu/train_long.sh): train from
#                            # models/k3-tiny on 16K rows, export to $OUT/model, passkey 8K..128K and 1M plus
#                            # tools/arith through `kestrel serve --device cuda`; TL_DEADLINE (560 s) bounds it
#   bench/gpu/run.sh suite   # there: the whole GPU suite on every checkpoint it looks for (nano, nano_vl, mini,
#                            # nano_tp_gpu and the nano draft, made in parallel); log in $OUT/gpu_suite.log, the
#                            # summary and any failure printed; SUITE_TIMEOUT (400 s) bounds the tests
#   bench/gpu/run.sh ab ROUNDS "ENV=A ENV2=B" "ENV=C" ... -- CMD [ARGS]
#                            # there: A/B by environment: CMD (a binary of .gpu-carry/ or any command) under each
#                            # setting in turn ("" = as is), ROUNDS times, each run headed by its setting; GREP (a
#                            # pattern) keeps only matching lines; AB_MINI=1 first makes /tmp/kestrel_ckpt/mini (for
#                            # bench_ops --perf --only model --model /tmp/kestrel_ckpt/mini)
#   bench/gpu/run.sh soak    # there: issue #24's memory soak (≤ ~3 min): `kestrel serve --device cuda` on
#                            # SOAK_MODEL (default models/k3-tiny) and `kestrel bench --soak`: SOAK_ROUNDS (10) rounds
#                            # of SOAK_STREAMS (1000) concurrent streams, 30 % of the clients leaving early, the
#                            # server's GPU memory and RSS per round, checked (GPU ≤ 64 MiB, RSS ≤ 16 MB from round
#                            # 3 to the last); then a second server with shared prefixes and a page pool small
#                            # enough to preempt (SOAK_PREFIX_ROUNDS, 6). $OUT: soak_{plain,prefix}.{json,log},
#                            # soak_server_logs.tgz (serve logs, end metrics).
# With the device tool: run `bench/gpu/run.sh test` with carry [".gpu-carry"].
# The device tool sends the session's main checkout, not a helper's worktree: from a worktree, copy
# .gpu-carry/ and bench/gpu/run.sh into a git-ignored folder F of that checkout (F/.gpu-carry,
# F/bench/gpu/run.sh, and reference/ for `all`/`serving`), carry [F] and run `bash F/bench/gpu/run.sh test`.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # "$0" again after the cd below
cd "$(dirname "$0")/../.."

# Unpacks .gpu-carry/pkg.tar.xz (binaries and lib/) into .gpu-carry/ once (COMMIT marks it done, whichever
# binaries were packed); puts lib/ on the loader path.
unpack() {
  [ -f .gpu-carry/COMMIT ] || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
    .gpu-carry/pkg.tar.xz .gpu-carry
  if [ -d .gpu-carry/pkg ]; then mv .gpu-carry/pkg/* .gpu-carry/ && rmdir .gpu-carry/pkg; fi
  export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
}

# When BIN does not find the toolkit's cuBLASLt, put the first copy found (e.g. the nvidia-cublas wheel's) on the path.
lt_path() {
  if ! ldd "$1" | grep -q "libcublasLt.so.13 => /"; then
    d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
    export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
  fi
}

# The reduced mini (4 layers at one TP8 rank's shapes, 4 experts): the step benchmarks' and tests' checkpoint.
make_mini() {
  [ -f "$1/config.json" ] || python3 reference/make_checkpoint.py --config mini --out "$1" --seed 1 --fast-experts \
    --no-vision --override num_experts=4 --override num_hidden_layers=4 --override vocab_size=8192 >/dev/null
}

# The kernel tracer (timeline modes): the binaries unpacked, the reduced mini made, the tracer present.
trace_setup() {
  unpack
  lt_path .gpu-carry/bench_ops
  make_mini /tmp/kestrel_ckpt/mini
  [ -f .gpu-carry/libkestrel_kernel_trace.so ] || { echo "$1: no libkestrel_kernel_trace.so packed" >&2; exit 2; }
}
# traced_step CSV [BENCH_OPS ARGS]: the reduced mini's step benchmark with every kernel's span written to CSV.
traced_step() {
  local csv="$1"
  shift
  CUDA_INJECTION64_PATH="$PWD/.gpu-carry/libkestrel_kernel_trace.so" KESTREL_TRACE_OUT="$csv" \
    .gpu-carry/bench_ops "$@" --perf --only model --model /tmp/kestrel_ckpt/mini
}

# Waits up to 120 s for `kestrel serve` on 127.0.0.1:PORT to answer /health; returns 1 at once if its process PID
# has exited (the callers decide whether that ends the mode), 0 when healthy or after the wait (as the loops did).
wait_healthy() {
  for _ in $(seq 240); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
}

case "${1:-}" in
  pack)
    # An existing build/ (configured as the developer likes) is reused; otherwise configure one. PACK_TARGETS
    # ("kestrel bench_ops ...") builds only those first (default: everything).
    if [ -f build/build.ninja ]; then ninja -C build ${PACK_TARGETS:-} >/dev/null; else scripts/build.sh ${PACK_TARGETS:-} >/dev/null; fi
    excl="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree
    grep -qx "/.gpu-carry/" "$excl" 2>/dev/null || echo "/.gpu-carry/" >> "$excl"
    rm -rf .gpu-carry && mkdir -p .gpu-carry/pkg/lib
    # PACK_SKIP="NAME ...": binaries left out, when the tree and the archive together would pass the device
    # tool's 64 MiB (e.g. PACK_SKIP=kestrel_gpu_tests for a benchmark-only run).
    skip() { case " ${PACK_SKIP:-} " in *" $(basename "$1") "*) return 0 ;; esac; return 1; }
    for b in build/tests/gpu/kestrel_gpu_tests build/src/cli/kestrel build/bench/bench_ops; do
      skip "$b" || objcopy --strip-debug "$b" ".gpu-carry/pkg/$(basename "$b")"
    done
    for b in build/bench/bench_moe build/bench/bench_mla build/bench/bench_kda build/bench/bench_indexer build/bench/bench_structured_engine build/bench/bench_sync build/bench/bench_overlap; do  # per-kernel benchmarks, when built
      [ -x "$b" ] && ! skip "$b" && objcopy --strip-debug "$b" ".gpu-carry/pkg/$(basename "$b")"
    done
    # The kernel tracer (timeline mode) and the CUPTI it links, when built and not skipped.
    t=build/bench/libkestrel_kernel_trace.so
    if [ -f "$t" ] && ! skip "$t"; then
      objcopy --strip-debug "$t" ".gpu-carry/pkg/$(basename "$t")"
      cp -L "$(ldd "$t" | awk '/libcupti/ {print $3; exit}')" .gpu-carry/pkg/lib/
    fi
    # PACK_EXTRA="kestrel_unit_tests": the CPU unit-test binary too (structured mode's k3-tiny run on the GPU engine).
    for n in ${PACK_EXTRA:-}; do
      b="$(find build -name "$n" -type f -perm -u+x | head -1)"
      [ -n "$b" ] && objcopy --strip-debug "$b" ".gpu-carry/pkg/$n"
    done
    git rev-parse --short HEAD > .gpu-carry/pkg/COMMIT
    # `kestrel` itself also links the image codecs and Open MPI (executor_mpi), which the device image lacks.
    for l in libfmt.so.9 libopenblas.so.0 libgomp.so.1 libgfortran.so.5 libquadmath.so.0 libicuuc.so.72 libicudata.so.72 \
             libjpeg.so.62 libpng16.so.16 libwebp.so.7 libxxhash.so.0 libz.so.1 libmpi.so.40 libopen-rte.so.40 \
             libopen-pal.so.40 libhwloc.so.15 libevent_core-2.1.so.7 libevent_pthreads-2.1.so.7 libudev.so.1; do
      cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" .gpu-carry/pkg/lib/
    done
    # Binaries + ICU + OpenBLAS are ~95 MB and the tree (with models/k3-tiny) ~36 MB, against the device
    # tool's 64 MiB: one xz archive (~18 MB) keeps room for eval sets; unpacked there by Python's lzma.
    tar cJf .gpu-carry/pkg.tar.xz -C .gpu-carry pkg && rm -rf .gpu-carry/pkg
    du -sh .gpu-carry
    ;;
  extras)
    mkdir -p .whl sets1m
    ls .whl/fla_core-0.6.0-*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q fla-core==0.6.0 --no-deps -d .whl
    if [ ! -f sets1m/passkey-1m.jsonl.xz ]; then
      # Three prompts of 1,048,576 tokens, the key at depths 0, 0.5 and 1 (each ≈ 40–60 s of prefill on the H200).
      t="$(mktemp -d)"
      (cd train && ../.venv/bin/python -m k3data.make_eval --out "$t" --min-context 1048576 --max-context 1048576 \
        --depths 0,0.5,1 --passkey-reps 1 --tools 0 --arith 0 --chat 0) && xz -9 -c "$t/passkey.jsonl" > sets1m/passkey-1m.jsonl.xz
      rm -rf "$t"
    fi
    du -sh .whl sets1m
    ;;
  test)
    unpack
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    lt_path .gpu-carry/kestrel_gpu_tests
    ldd .gpu-carry/kestrel_gpu_tests | grep -E "not found|cublasLt|openblas" || true
    # NCCL is dlopen'ed (src/parallel/nccl_comm.h); point at a copy when the loader path lacks one
    # (PyTorch's wheels ship site-packages/nvidia/nccl/lib/libnccl.so.2).
    if [ -z "${KESTREL_NCCL_LIBRARY:-}" ] && ! ldconfig -p | grep -q "libnccl.so.2 "; then
      n="$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -1)"
      [ -n "$n" ] && export KESTREL_NCCL_LIBRARY="$n" && echo "NCCL: $n"
    fi
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" .gpu-carry/kestrel_gpu_tests "${@:2}"
    ;;
  all)
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null &
    make_mini "$ck/mini" &
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
    make_mini "$ck/mini" &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/mini"
    "$self" test --gtest_filter='GpuServingOps.*:GpuSampling.*:GpuEngine.*:GpuGraphs.*:GpuModel.*' 2>&1 \
      | tee "$out/gpu_serving_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -80 || true
    "$self" bench --model "$ck/mini" --only model 2>&1 | tee "$out/decode_step.md"
    ;;
  tp)
    # Tensor and expert parallelism on the GPU engine (issue #16): nano and nano_tp_gpu (nano with 4 indexer
    # heads and I = 256, so TP4 leaves 64 expert columns per rank; both have 16 experts, so EP2 and EP4 hold 8
    # and 4 whole experts per rank) checkpoints, then GpuTp.* — the same-device communicator against the CPU
    # twin's collectives, the engine as TP2/TP4 and TP2+EP2/TP4+EP4 on this one GPU against TP1, the one-shot
    # all-reduce of --enable-custom-all-reduce per rank and in the engine (GpuTp.CustomAllReduce*) — and
    # GpuMoe.ExpertParallel* (one EP rank's expert kernels against the CPU twin).
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null &
    [ -f "$ck/nano_tp_gpu/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano_tp_gpu" \
      --seed 2 --no-vision --override index_n_heads=4 --override moe_intermediate_size=256 >/dev/null &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/nano_tp_gpu"
    "$self" test --gtest_filter="${TP_TESTS:-GpuTp.*:GpuMoe.ExpertParallel*}" 2>&1 | tee "$out/gpu_tp_tests.log" | tail -60 || true
    ;;
  vision)
    # Images on the GPU (issue #21 point 4): the nano checkpoint WITH its vision tower (nano_vl), the encoder's
    # tests (GpuVision.*) and the GPU engine with images against the CPU engine (GpuEngineVision.*), then the
    # encoder's time per 1024 x 1024 image at the real vision dims (bench_ops --only vision). Extra arguments
    # go to the test binary (e.g. --gtest_filter='GpuEngineVision.*').
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano_vl/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano_vl" --seed 1 >/dev/null
    export KESTREL_GPU_CKPTS="$ck/nano_vl"
    "$self" test --gtest_filter='GpuVision.*:GpuEngineVision.*' "${@:2}" 2>&1 | tee "$out/gpu_vision_tests.log" | tail -40 || true
    "$self" bench --perf --only vision 2>&1 | tee "$out/bench_vision.md" | tail -20
    ;;
  spec)
    # DSpark speculation on the GPU (issue #19, docs/speculative.md): the nano checkpoint and its random draft,
    # GpuSpec.* (verify rows, taps and the KDA keep against decodes and the CPU model; the GPU engine with
    # speculation against without, preemption and prefix hits; the agreeing draft); then TPOT with and without
    # speculation through `kestrel serve --device cuda` + `kestrel bench` (256 in / 128 out, --ignore-eos,
    # random prompts, then k3-tiny's eval prompts: see below; acceptance length from the server's /metrics): k3-tiny with models/k3-tiny-dspark at
    # c = SPEC_CONC (default 1 8 32) in SPEC_MODES (plain, host: the draft on the host, gpu: the draft on the
    # device, KESTREL_DRAFT_ON_GPU=1, gpueager: gpu with the verify steps eager, KESTREL_SPEC_GRAPHS=0, the A/B
    # of the verify graphs; gpuperreq: gpu with one draft call per request, KESTREL_DRAFT_BATCHED=0, the A/B of
    # the batched draft; gpu runs the batched draft in CUDA graphs, the default since issue #19 point 4; gpunograph:
    # gpu with the draft's launches eager, KESTREL_DRAFT_GRAPHS=0, the A/B; gpugraph: the same as gpu, kept for
    # older result files; gpuabs: gpu with the draft's attention absorbed, KESTREL_DRAFT_ATTN=absorbed), and the reduced mini with a random draft at real dimensions (make_draft.py
    # --config mini, 5 layers; its taps inside the 4 layers) at c = 1, plain and gpu: the cost of one speculative
    # step at real shapes. SPEC_PROFILE=N (N ≥ 1; KESTREL_SPEC_PROFILE, runtime/spec_profile.h): the servers print
    # a per-phase timing of the speculative steps to stderr (every N steps if N > 1, and at exit); each concurrency
    # then runs on a server of its own and the summaries go to $out/spec_profile_NAME_MODE_cC.txt. spec_keys.py turns the result files into perf.json's dspark_* keys ($OUT/perf.json, a
    # copy of bench/gpu/perf.json with its "dspark" section replaced). Extra arguments go to the test binary.
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 --no-vision >/dev/null
    [ -f "$ck/nano-dspark/config.json" ] || python3 reference/make_draft.py --config nano --out "$ck/nano-dspark" --seed 1 >/dev/null
    # The reduced mini and its draft are made while the tests run (about a minute: the draft is 2.3 B parameters).
    (
      make_mini "$ck/mini"
      [ -f "$ck/mini-dspark/config.json" ] || python3 reference/make_draft.py --config mini --out "$ck/mini-dspark" --seed 1 \
        --override vocab_size=8192 --override 'target_layer_ids=[0,1,2,3]' >/dev/null
    ) &
    mk=$!
    export KESTREL_GPU_CKPTS="$ck/nano" KESTREL_GPU_DSPARK="$ck/nano-dspark"
    "$self" test --gtest_filter='GpuSpec.*:GpuSpecGraph.*' "${@:2}" 2>&1 | tee "$out/gpu_spec_tests.log" | grep -vE "^\[ RUN|^\[       OK" | tail -40 || true
    unpack
    if ! ldd .gpu-carry/kestrel | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    port=18126
    # spec_run NAME MODEL DRAFT MODE C...: one server, kestrel bench at each concurrency → $out/spec_NAME_MODE_cC.json
    spec_run() {
      local name=$1 model=$2 draft=$3 mode=$4 c n
      shift 4
      local args=()
      [ "$mode" != plain ] && args=(--speculative-config "{\"method\":\"dspark\",\"model\":\"$draft\",\"num_speculative_tokens\":7}")
      KESTREL_SPEC_GRAPHS=$([ "$mode" = gpueager ] && echo 0 || echo 1) \
      KESTREL_DRAFT_BATCHED=$([ "$mode" = gpuperreq ] && echo 0 || echo 1) \
      KESTREL_DRAFT_GRAPHS=$([ "$mode" = gpunograph ] && echo 0 || echo 1) \
      KESTREL_SPEC_PROFILE="${SPEC_PROFILE:-0}" \
      KESTREL_DRAFT_ATTN=$([ "$mode" = gpuabs ] && echo absorbed || echo naive) \
      KESTREL_DRAFT_ON_GPU=$([ "${mode#gpu}" != "$mode" ] && echo 1 || echo 0) .gpu-carry/kestrel serve --device cuda --model "$model" \
        --port "$port" --max-num-seqs 32 --memory-budget 16G "${args[@]}" >"$out/spec_serve_${name}_$mode$tag.log" 2>&1 &
      local srv=$!
      wait_healthy "$port" "$srv" || { echo "spec: $name $mode: the server did not come up"; tail -5 "$out/spec_serve_${name}_$mode$tag.log"; return 0; }
      # The prompts: random words (256 tokens, 128 out, --ignore-eos), or for k3tinytasks / k3tinytaskseos k3-tiny's
      # own eval prompts through the chat endpoint, 128 tokens out with / without --ignore-eos.
      local data=(--input-len 256 --ignore-eos)
      case "$name" in
        k3tinytasks) data=(--endpoint /v1/chat/completions --dataset custom --dataset-path "$tasks" --ignore-eos) ;;
        k3tinytaskseos) data=(--endpoint /v1/chat/completions --dataset custom --dataset-path "$tasks") ;;
      esac
      for c in "$@"; do
        n=$(( c == 1 ? 16 : 2 * c ))
        .gpu-carry/kestrel bench --base-url "http://127.0.0.1:$port" --tokenizer "$model" "${data[@]}" \
          --output-len 128 --num-prompts "$n" --max-concurrency "$c" --num-warmups 2 --no-progress \
          --result-file "$out/spec_${name}_${mode}_c$c.json" >"$out/spec_bench_${name}_${mode}_c$c.log" 2>&1 || true
        grep -E "TPOT|Acceptance length|Output token throughput" "$out/spec_bench_${name}_${mode}_c$c.log" | sed "s/^/$name $mode c=$c: /"
      done
      kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
      if [ "${SPEC_PROFILE:-0}" != 0 ]; then
        grep -A40 "^spec-profile" "$out/spec_serve_${name}_$mode$tag.log" | grep -E "^spec-profile|^  " \
          >"$out/spec_profile_${name}_$mode$tag.txt" || true
        if [ -s "$out/spec_profile_${name}_$mode$tag.txt" ]; then tail -30 "$out/spec_profile_${name}_$mode$tag.txt"; fi
      fi
    }
    # spec_runs NAME MODEL DRAFT MODE C...: spec_run, one server per concurrency when profiling (a summary per c).
    spec_runs() {
      local name=$1 model=$2 draft=$3 mode=$4 c
      shift 4
      if [ "${SPEC_PROFILE:-0}" = 0 ] || [ "$mode" = plain ]; then tag="" spec_run "$name" "$model" "$draft" "$mode" "$@"; return; fi
      for c in "$@"; do tag="_c$c" spec_run "$name" "$model" "$draft" "$mode" "$c"; done
    }
    for mode in ${SPEC_MODES:-plain host gpu gpuperreq gpunograph gpueager gpuabs}; do
      spec_runs k3tiny models/k3-tiny models/k3-tiny-dspark "$mode" ${SPEC_CONC:-1 8 32}
    done
    # k3-tiny on the prompts it and its draft were made for (its eval sets: chat, tool calls, arithmetic, pass
    # keys; kestrel bench --dataset custom), where acceptance is the model card's rather than random words' worst
    # case: SPEC_TASK_MODES (default plain gpu) at SPEC_CONC, past EOS (k3tinytasks) and stopping there
    # (k3tinytaskseos).
    tasks=/tmp/spec_tasks.jsonl
    cat models/k3-tiny/eval/*.jsonl > "$tasks"
    for mode in ${SPEC_TASK_MODES:-plain gpu}; do
      spec_runs k3tinytasks models/k3-tiny models/k3-tiny-dspark "$mode" ${SPEC_CONC:-1 8 32}
      spec_runs k3tinytaskseos models/k3-tiny models/k3-tiny-dspark "$mode" ${SPEC_CONC:-1 8 32}
    done
    wait "$mk" || true
    for mode in ${SPEC_MINI_MODES:-plain gpu gpunograph gpuabs}; do
      spec_runs mini "$ck/mini" "$ck/mini-dspark" "$mode" 1
    done
    cp bench/gpu/perf.json "$out/perf.json" 2>/dev/null || true
    python3 bench/gpu/spec_keys.py --dir "$out" --perf "$out/perf.json" --commit "$(cat .gpu-carry/COMMIT 2>/dev/null)" \
      --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" || true
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
    # The SUMMARY lines are the target (issue #20 point 3): constrained vs free decode step, medians over the reps,
    # ≤ 5 % at batch 1 and 64; "device: Δ tail + late masks" is the structured outputs' own share (the step after
    # the forward, plus masks ready only after it) and "Δ forward done" what the constrained tokens changed in the
    # model's work. The mask pool has its automatic size (a quarter of the cores); the second run pins it to one
    # thread, the engine's old single worker, to show what the pool buys.
    .gpu-carry/bench_structured_engine --model models/k3-tiny --device cuda --batch 1,64 --tokens 64 --reps 5 2>&1 \
      | tee "$out/structured_engine_cuda.md"
    .gpu-carry/bench_structured_engine --model models/k3-tiny --device cuda --batch 1,64 --tokens 64 --reps 5 \
      --mask-threads 1 2>&1 | tee "$out/structured_engine_cuda_1thread.md"
    grep -h SUMMARY "$out/structured_engine_cuda.md" "$out/structured_engine_cuda_1thread.md" || true
    # Issue #20 point 5: K3TINY_REQUESTS strict-schema requests (half as many tool calls) on the GPU engine.
    if [ -x .gpu-carry/kestrel_unit_tests ] && [ -n "${K3TINY_REQUESTS:-}" ]; then
      KESTREL_K3TINY_DEVICE=cuda KESTREL_K3TINY_REQUESTS="$K3TINY_REQUESTS" .gpu-carry/kestrel_unit_tests \
        --gtest_filter='K3TinyStructured.*' 2>&1 | tee "$out/k3tiny_structured_cuda.log" | tail -20
    fi
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
    make_mini "$ck/mini" &
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
  kda)
    # KDA_DEADLINE (s, default 560) bounds the run inside the device tool's limit; KDA_VARIANTS lists the
    # kda_chunked variants (INTRA,SEQ,F16) the model test runs under besides the engine's default.
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    end=$(( $(date +%s) + ${KDA_DEADLINE:-560} ))
    left() { echo $(( end - $(date +%s) > 5 ? end - $(date +%s) : 5 )); }
    unpack
    if ! ldd .gpu-carry/kestrel_gpu_tests | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    mkdir -p "$ck"
    [ -f "$ck/nano/config.json" ] || python3 reference/make_checkpoint.py --config nano --out "$ck/nano" --seed 1 \
      --no-vision >/dev/null &
    ckpt_pid=$!
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    OMP_NUM_THREADS="$(nproc)" timeout "$(left)" .gpu-carry/kestrel_gpu_tests \
      --gtest_filter='GpuKda.*:GpuOps.Kda*:GpuDecode.KdaDecodeFused*' 2>&1 | tee "$out/kda_tests.log" \
      | grep -vE "^\[ RUN|^\[       OK" | tail -40 || true
    timeout "$(left)" .gpu-carry/bench_kda --perf 2>&1 | tee "$out/kda_perf.log" | grep -E "PERF|error" || true
    python3 -c "import fla" 2>/dev/null && { timeout "$(left)" python3 bench/gpu/kda_peer.py --perf 2>&1 \
      | tee "$out/kda_peer.log" | grep PERF || true; }
    wait "$ckpt_pid"
    : > "$out/kda_model.log"
    for v in "" ${KDA_VARIANTS:-2,2,0 2,4,0 2,4,1}; do
      echo "### KESTREL_KDA_CHUNKED=${v:-(engine default)}" | tee -a "$out/kda_model.log"
      KESTREL_KDA_CHUNKED="$v" KESTREL_GPU_CKPTS="$ck/nano" OMP_NUM_THREADS="$(nproc)" timeout "$(left)" \
        .gpu-carry/kestrel_gpu_tests --gtest_filter='GpuModel.*' --gtest_brief=1 2>&1 | tee -a "$out/kda_model.log" \
        | tail -4 || true
    done
    timeout "$(left)" .gpu-carry/bench_kda ${KDA_BENCH_ARGS:---quick} 2>&1 | tee "$out/bench_kda.md" || true
    ;;
  bench_kda)
    unpack
    if ! ldd .gpu-carry/bench_kda | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    .gpu-carry/bench_kda "${@:2}"
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
    wait_healthy "$port" "$srv" || { tail -20 "$out/serve.log"; exit 1; }
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
  train_long)
    # bench/gpu/train_long.sh: k3-tiny's long-context stage, its export and the engine's passkey 8K..1M + kept
    # skills, in one call (its header lists the TL_* settings).
    unpack
    export -f wait_healthy
    exec bash bench/gpu/train_long.sh
    ;;
  profile)
    # Per-kernel GPU time of one batch-1 decode step of the reduced mini, by Nsight Compute (hardware timer,
    # kernels serialised: no launch gaps or PDL overlap, so the sum is below the step's wall time). PROFILE_STEP
    # (default 3 = the second eager decode step) picks the forward; $OUT: ncu_step.csv, profile_step.md.
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    unpack
    mkdir -p "$ck"
    make_mini "$ck/mini"
    ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
    # Launches: the ceilings' few hundred, then prefill + eager steps; 3,000 covers several forwards.
    timeout "${PROFILE_TIMEOUT:-300}" "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv --launch-count "${PROFILE_LAUNCHES:-3000}" \
      .gpu-carry/bench_ops --perf --only model --model "$ck/mini" > "$out/ncu_step.csv" 2> "$out/ncu_step.err" || true
    python3 bench/gpu/ncu_step.py "$out/ncu_step.csv" --step "${PROFILE_STEP:-3}" | tee "$out/profile_step.md" | head -150
    ;;
  timeline)
    # Kernel timeline of the reduced mini's decode-step graphs (header). The tracer is a CUPTI injection library:
    # the CUDA driver loads it into bench_ops (CUDA_INJECTION64_PATH); it writes every kernel's span at exit.
    out="${OUT:-/tmp}"
    trace_setup timeline
    traced_step "$out/trace.csv" "${@:2}" > "$out/timeline_bench.log" 2>&1 || echo "timeline: bench_ops exit $?"
    grep -E "^PERF decode_step|kernel_trace" "$out/timeline_bench.log" || true
    python3 bench/gpu/timeline.py "$out/trace.csv" > "$out/timeline.md" && head -"${TIMELINE_LINES:-80}" "$out/timeline.md"
    xz -6 -f "$out/trace.csv"
    ;;
  timeline_ab)
    # The same timeline under several settings, alternated ROUNDS times, then each kernel name's exposed time side
    # by side (timeline.py with several traces): `run.sh timeline_ab 2 "" "KESTREL_ATTNRES_NB=0"`. A setting is
    # VAR=VALUE words ("" = as is); columns s<i>r<round>, in the order given.
    out="${OUT:-/tmp}"
    [ "$#" -ge 3 ] || { echo "usage: $0 timeline_ab ROUNDS SETTING..." >&2; exit 2; }
    rounds="$2"
    shift 2
    trace_setup timeline_ab
    traces=() labels=()
    for r in $(seq "$rounds"); do
      i=0
      for s in "$@"; do
        t="$out/trace_s${i}r$r.csv"
        echo "== s${i}r$r: ${s:-(as is)}"
        # shellcheck disable=SC2086  # a setting is several VAR=VALUE words
        (for kv in $s; do export "${kv?}"; done; traced_step "$t") 2>&1 | grep -E "^PERF decode_step" || true
        traces+=("$t") labels+=("s${i}r$r")
        i=$((i + 1))
      done
    done
    python3 bench/gpu/timeline.py "${traces[@]}" --labels "$(IFS=,; echo "${labels[*]}")" > "$out/timeline_ab.md" &&
      head -"${TIMELINE_LINES:-40}" "$out/timeline_ab.md"
    xz -6 -f "${traces[@]}"
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
    make_mini "$ck/mini" &
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
    # Twice: as served by default, then with --async-scheduling (run-ahead decode steps; keys serve_mini_async_*).
    port=18124
    for mode in "" async; do
      .gpu-carry/kestrel serve --device cuda --model "$ck/mini" --port "$port" --max-num-seqs 64 \
        --gpu-memory-utilization 0.5 ${mode:+--async-scheduling} >"$out/perf/serve${mode:+_$mode}.log" 2>&1 &
      srv=$!
      wait_healthy "$port" "$srv" || true
      for c in 1 64; do
        n=$(( c == 1 ? 16 : 192 ))
        timeout "${5:-$(left)}" .gpu-carry/kestrel bench --base-url "http://127.0.0.1:$port" --tokenizer "$ck/mini" \
          --input-len 1024 --output-len 128 --ignore-eos --num-prompts "$n" --max-concurrency "$c" --num-warmups 2 \
          --no-progress --save-detailed --result-file "$out/perf/serve${mode:+_$mode}_c$c.json" \
          >"$out/perf/serve_bench${mode:+_$mode}_c$c.log" 2>&1 || true
      done
      kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    done
    # One million tokens: k3-tiny after its long-context stage (PASSKEY_MODEL, default models/k3-tiny-long)
    # answers pass keys at 1,048,576 tokens of context (issue #15), when the set (train/k3data/make_eval.py
    # --min-context 1048576 --max-context 1048576, xz-compressed) is carried.
    pk="${PASSKEY_SET:-sets1m/passkey-1m.jsonl.xz}"
    if [ -f "$pk" ]; then
      port=18125
      .gpu-carry/kestrel serve --device cuda --model "${PASSKEY_MODEL:-models/k3-tiny-long}" --port "$port" --max-num-seqs 4 \
        --max-model-len 1056768 --memory-budget 8G >"$out/perf/serve_1m.log" 2>&1 &
      srv=$!
      wait_healthy "$port" "$srv" || true
      timeout "$(left)" python3 bench/gpu/passkey_long.py --base-url "http://127.0.0.1:$port" --set "$pk" 2>&1 \
        | tee "$out/perf/passkey_1m.log" || true
      kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
    fi
    python3 bench/gpu/perf.py --logs "$out/perf" --out "$out/perf.json" --commit "$(cat .gpu-carry/COMMIT 2>/dev/null)" \
      --machine "$(cat "$out/perf/machine.txt")" \
      --serve "serve_mini_c1=$out/perf/serve_c1.json" "serve_mini_c64=$out/perf/serve_c64.json" \
      "serve_mini_async_c1=$out/perf/serve_async_c1.json" "serve_mini_async_c64=$out/perf/serve_async_c64.json" \
      | tee "$out/perf.md"
    # The device tool brings back at most 8 files: the logs travel as one archive.
    tar czf "$out/perf_logs.tgz" -C "$out" perf && rm -rf "$out/perf"
    ;;
  soak)
    # Issue #24 point 3 on the H200 (record the tables in bench/RESULTS.md). Two servers, one after the other,
    # each serving only the soak (the GPU column is the process's memory per nvidia-smi, or the device's when the
    # container hides the pid: '*'). SOAK_DEADLINE (s, default 200) bounds the whole; a run cut off leaves its
    # per-round rows in the .log but no .json. Exit status: 1 when a soak's check failed.
    out="${OUT:-/tmp}"
    model="${SOAK_MODEL:-models/k3-tiny}"
    end=$(( $(date +%s) + ${SOAK_DEADLINE:-200} ))
    left() { echo $(( end - $(date +%s) > 5 ? end - $(date +%s) : 5 )); }
    unpack
    if ! ldd .gpu-carry/kestrel | grep -q "libcublasLt.so.13 => /"; then
      d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
      export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/soak_machine.txt"
    status=0
    # soak_one NAME PORT "SERVE FLAGS" "BENCH FLAGS" [SECONDS]: one server, one soak (at most SECONDS, default
    # what is left), the server stopped (SIGTERM) after.
    soak_one() {
      local name="$1" port="$2" srv rc=0
      # shellcheck disable=SC2086  # the flag lists are word-split on purpose
      .gpu-carry/kestrel serve --device cuda --model "$model" --served-model-name soak --port "$port" --debug-routes \
        --max-queue 4096 $3 >"$out/soak_${name}_serve.log" 2>&1 &
      srv=$!
      wait_healthy "$port" "$srv" || { tail -20 "$out/soak_${name}_serve.log"; status=1; return; }
      # shellcheck disable=SC2086
      timeout "${5:-$(left)}" .gpu-carry/kestrel bench --base-url "http://127.0.0.1:$port" --model soak --tokenizer "$model" \
        --server-pid "$srv" --no-progress --ignore-eos --soak-settle 1 $4 --result-file "$out/soak_$name.json" \
        2>&1 | tee "$out/soak_$name.log" || rc=$?
      [ "$rc" = 0 ] || { echo "soak $name: exit $rc"; status=1; }
      python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics', timeout=10).read().decode())" \
        2>/dev/null | grep -E "^(vllm:(num_preemptions|prefix_cache_hits|request_success)|kestrel:kv_pages)" \
        | tee "$out/soak_${name}_metrics.txt" || true
      kill $srv 2>/dev/null; wait $srv 2>/dev/null || true
      grep -hiE "error|fatal" "$out/soak_${name}_serve.log" | head -5 || true
    }
    # 1. The operator's run (the issue's): rounds of 1,000 streams on the chat endpoint, 256 running at most.
    soak_one plain 18126 "--max-num-seqs 256 --memory-budget ${SOAK_MEMORY:-8G}" \
      "--endpoint /v1/chat/completions --soak ${SOAK_ROUNDS:-10} --num-prompts ${SOAK_STREAMS:-1000} --input-len 128 \
       --range-ratio 0.5 --output-len 32 --seed 24 --soak-baseline-round 3 --soak-max-gpu-growth 64 --soak-max-rss-growth 16" \
      "$(( $(left) > 100 ? $(left) - ${SOAK_PREFIX_SECONDS:-70} : $(left) ))"  # leave the second soak its time
    # 2. Shared prefixes (4 × 512 tokens) and a pool of 16-token pages smaller than the running requests want:
    #    on k3-tiny, 32M is 64 requests' KDA state slots (~28.6 MB) and 7,008 tokens of pages, against ~12K tokens
    #    for 64 requests of ~640-token prompts (512 shared) + 32 out: prefix-cache hits, checkpoints, eviction
    #    and preemption under the same churn (soak_prefix_metrics.txt: num_preemptions > 0); every page
    #    accounted for after each round.
    soak_one prefix 18127 "--max-num-seqs 64 --memory-budget ${SOAK_PREFIX_MEMORY:-32M} --block-size 16 --max-num-batched-tokens 1024" \
      "--endpoint /v1/completions --soak ${SOAK_PREFIX_ROUNDS:-6} --num-prompts ${SOAK_PREFIX_STREAMS:-400} \
       --input-len 128 --range-ratio 0.5 --output-len 32 --soak-prefix-len 512 --soak-prefix-groups 4 --seed 25 \
       --soak-baseline-round 3 --soak-max-gpu-growth 64 --soak-max-rss-growth 16"
    # The device tool brings back at most 8 files: the server logs and end metrics travel as one archive.
    (cd "$out" && tar czf soak_server_logs.tgz soak_machine.txt soak_*_serve.log soak_*_metrics.txt 2>/dev/null \
      && rm -f soak_*_serve.log soak_*_metrics.txt) || true
    exit $status
    ;;
  bench)
    unpack
    lt_path .gpu-carry/bench_ops
    .gpu-carry/bench_ops "${@:2}"
    ;;
  suite)
    out="${OUT:-/tmp}"
    ck=/tmp/kestrel_ckpt
    mkdir -p "$ck"
    mk() { [ -f "$ck/$1/config.json" ] || python3 reference/make_checkpoint.py --out "$ck/$1" "${@:2}" >/dev/null; }
    mk nano --config nano --seed 1 --no-vision &
    mk nano_vl --config nano --seed 1 &
    make_mini "$ck/mini" &
    mk nano_tp_gpu --config nano --seed 2 --no-vision --override index_n_heads=4 --override moe_intermediate_size=256 &
    [ -f "$ck/nano-dspark/config.json" ] || python3 reference/make_draft.py --config nano --out "$ck/nano-dspark" --seed 1 >/dev/null &
    wait
    export KESTREL_GPU_CKPTS="$ck/nano:$ck/nano_vl:$ck/mini:$ck/nano_tp_gpu" KESTREL_GPU_DSPARK="$ck/nano-dspark"
    timeout "${SUITE_TIMEOUT:-400}" "$self" test --gtest_brief=1 "${@:2}" > "$out/gpu_suite.log" 2>&1 || echo "suite: exit $?"
    grep -E "^\[ +(FAILED|PASSED|SKIPPED) +\]|tests? from .* ran|Failure$" "$out/gpu_suite.log" | head -40 || true
    ;;
  ab)
    unpack
    [ "$#" -ge 4 ] || { echo "usage: $0 ab ROUNDS SETTING... -- CMD [ARGS]" >&2; exit 2; }
    rounds="$2"
    shift 2
    sets=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do sets+=("$1"); shift; done
    [ "$#" -ge 2 ] || { echo "ab: no command after --" >&2; exit 2; }
    shift
    cmd=("$@")
    [ -x ".gpu-carry/${cmd[0]}" ] && cmd[0]=".gpu-carry/${cmd[0]}" && lt_path "${cmd[0]}"
    [ "${AB_MINI:-0}" = 1 ] && make_mini /tmp/kestrel_ckpt/mini
    for r in $(seq "$rounds"); do
      for s in "${sets[@]}"; do
        echo "== round $r: ${s:-(as is)}"
        # shellcheck disable=SC2086  # a setting is several VAR=VALUE words
        env $s "${cmd[@]}" 2>&1 | { if [ -n "${GREP:-}" ]; then grep -E "$GREP" || true; else cat; fi; } || echo "ab: exit $?"
      done
    done
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
    echo "usage: $0 pack|test|suite|ab|all|serving|tp|structured|vision|decode|kda|eval|timeline|timeline_ab|perf|soak|train_long|bench|bench_mla|bench_kda" >&2
    exit 2
    ;;
esac

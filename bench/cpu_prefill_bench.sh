#!/usr/bin/env bash
# Prefill rate of `kestrel serve --device cpu` at several prompt lengths (issue #22's prefill targets).
#   bench/cpu_prefill_bench.sh CKPT_DIR [PROMPTS_PER_LENGTH] [LENGTH...]
# Starts one server, warms it (one request of the first length: the weights are packed on first use; a
# step's buffers are per chunk of at most 256 tokens, so longer prompts need no other warm-up), then
# per length sends PROMPTS_PER_LENGTH requests one
# at a time with one output token and prints: prefill tok/s in wall clock (prompt tokens / Σ TTFT) and
# per server CPU second (user + system from /proc: the machine is shared, so this is the figure that
# does not move with the load), and the GFLOP/s both mean at FLOP_PER_TOKEN (default 14.0e6: k3-tiny's
# 2 × 7.0 M weights a token multiplies). Compare with `kestrel bench --cpu-ceilings` (GEMM rate).
set -euo pipefail
ckpt=${1:?checkpoint directory}
n=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
lens=("$@")
[ ${#lens[@]} -eq 0 ] && lens=(2048 16384)
bin=${KESTREL_BIN:-build/src/cli/kestrel}
out=${OUT_DIR:-$(mktemp -d)}
port=${PORT:-18792}
fpt=${FLOP_PER_TOKEN:-14.0e6}
# shellcheck disable=SC2086
"$bin" serve --model "$ckpt" --device cpu --port "$port" --served-model-name m --no-prefix-cache ${SERVE_FLAGS:-} \
  >"$out/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
cpu_s() { awk '{print ($14 + $15) / '"$(getconf CLK_TCK)"'}' "/proc/$server/stat"; }
run() {  # run LEN PROMPTS JSON [SEED] (no prefix cache: a repeated prompt is prefilled again)
  "$bin" bench --base-url "http://127.0.0.1:$port" --model m --tokenizer "$ckpt" --input-len "$1" --output-len 1 \
    --num-prompts "$2" --max-concurrency 1 --num-warmups 0 --ignore-eos --seed "${4:-$1}" --no-progress \
    --ready-check-timeout 120 --result-file "$3" >/dev/null 2>&1
}
run "${lens[0]}" 1 "$out/warm.json" 7
for len in "${lens[@]}"; do
  load0=$(cut -d' ' -f1 /proc/loadavg)
  cpu0=$(cpu_s)
  run "$len" "$n" "$out/p$len.json"
  cpu1=$(cpu_s)
  load1=$(cut -d' ' -f1 /proc/loadavg)
  python3 - "$out/p$len.json" "$len" "$cpu0" "$cpu1" "$load0" "$load1" "$fpt" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
toks = r["total_input_tokens"]
ttft = r["mean_ttft_ms"] * r["completed"] / 1e3
cpu = float(sys.argv[4]) - float(sys.argv[3])
f = float(sys.argv[7])
print(f"len {sys.argv[2]:>6}  prompts {r['completed']}  wall {toks / ttft:7.1f} tok/s ({toks * f / ttft / 1e9:5.1f} GFLOP/s)  "
      f"server CPU {cpu:6.2f} s: {toks / cpu:7.1f} tok/CPU-s ({toks * f / cpu / 1e9:5.1f} GFLOP/CPU-s)  "
      f"load {sys.argv[5]} -> {sys.argv[6]}")
PY
done
echo "results in $out"

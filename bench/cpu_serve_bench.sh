#!/usr/bin/env bash
# `kestrel bench` against `kestrel serve --device cpu` at several concurrencies (issue #22's table).
#   bench/cpu_serve_bench.sh CKPT_DIR [INPUT_LEN] [OUTPUT_LEN] [NUM_PROMPTS] [CONCURRENCY...]
# Starts one server (all cores, --max-num-seqs = the largest concurrency), runs the client once per
# concurrency with 2 warm-ups and --ignore-eos, prints one line per run (output tok/s, TTFT and TPOT
# medians, the server's CPU seconds (user + system, from /proc) per output token, and the load average:
# the machine is shared, so the CPU time is the load-independent figure) and leaves the JSON results in
# $OUT_DIR (default: a temporary directory). Extra server flags go in $SERVE_FLAGS (e.g. "--threads 1").
set -euo pipefail
ckpt=${1:?checkpoint directory}
in_len=${2:-256}
out_len=${3:-64}
prompts=${4:-32}
shift $(( $# > 4 ? 4 : $# ))
levels=("$@")
[ ${#levels[@]} -eq 0 ] && levels=(1 4 16)
max=$(printf '%s\n' "${levels[@]}" | sort -n | tail -1)
bin=${KESTREL_BIN:-build/src/cli/kestrel}
out=${OUT_DIR:-$(mktemp -d)}
port=${PORT:-18791}
# shellcheck disable=SC2086
"$bin" serve --model "$ckpt" --device cpu --port "$port" --max-num-seqs "$max" --served-model-name m \
  ${SERVE_FLAGS:-} >"$out/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
cpu_s() { awk '{print ($14 + $15) / '"$(getconf CLK_TCK)"'}' "/proc/$server/stat"; }
for c in "${levels[@]}"; do
  load0=$(cut -d' ' -f1 /proc/loadavg)
  "$bin" bench --base-url "http://127.0.0.1:$port" --model m --tokenizer "$ckpt" --input-len "$in_len" \
    --output-len 2 --num-prompts 1 --max-concurrency 1 --num-warmups 0 --ignore-eos --seed 1 --no-progress \
    --ready-check-timeout 120 >/dev/null 2>&1  # the server is up and warm before the CPU clock is read
  cpu0=$(cpu_s)
  "$bin" bench --base-url "http://127.0.0.1:$port" --model m --tokenizer "$ckpt" --input-len "$in_len" \
    --output-len "$out_len" --num-prompts "$prompts" --max-concurrency "$c" --num-warmups 2 --ignore-eos \
    --seed 0 --no-progress --ready-check-timeout 120 --result-file "$out/c$c.json" >"$out/c$c.txt" 2>&1
  cpu1=$(cpu_s)
  load1=$(cut -d' ' -f1 /proc/loadavg)
  python3 - "$out/c$c.json" "$c" "$cpu0" "$cpu1" "$load0" "$load1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
cpu = float(sys.argv[4]) - float(sys.argv[3])
print(f"c={sys.argv[2]:>2}  completed {r['completed']}  output tok/s {r['output_throughput']:.1f}  "
      f"TTFT median {r['median_ttft_ms']:.0f} ms  TPOT median {r['median_tpot_ms']:.2f} ms  "
      f"duration {r['duration']:.1f} s  server CPU {cpu:.1f} s = {1e3 * cpu / r['total_output_tokens']:.1f} ms"
      f"/output token  load {sys.argv[5]} -> {sys.argv[6]}")
PY
done
echo "results in $out"

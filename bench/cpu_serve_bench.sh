#!/usr/bin/env bash
# `kestrel bench` against `kestrel serve --device cpu` at several concurrencies (issue #22's table).
#   bench/cpu_serve_bench.sh CKPT_DIR [INPUT_LEN] [OUTPUT_LEN] [NUM_PROMPTS] [CONCURRENCY...]
# Starts one server (all cores, --max-num-seqs = the largest concurrency), runs the client once per
# concurrency with 2 warm-ups and --ignore-eos, prints one line per run (output tok/s, TTFT and TPOT
# medians) and leaves the JSON results in $OUT_DIR (default: a temporary directory). Extra server flags
# go in $SERVE_FLAGS (e.g. "--threads 1").
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
for c in "${levels[@]}"; do
  "$bin" bench --base-url "http://127.0.0.1:$port" --model m --tokenizer "$ckpt" --input-len "$in_len" \
    --output-len "$out_len" --num-prompts "$prompts" --max-concurrency "$c" --num-warmups 2 --ignore-eos \
    --seed 0 --no-progress --ready-check-timeout 120 --result-file "$out/c$c.json" >"$out/c$c.txt" 2>&1
  python3 - "$out/c$c.json" "$c" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"c={sys.argv[2]:>2}  completed {r['completed']}  output tok/s {r['output_throughput']:.1f}  "
      f"TTFT median {r['median_ttft_ms']:.0f} ms  TPOT median {r['median_tpot_ms']:.2f} ms  "
      f"duration {r['duration']:.1f} s")
PY
done
echo "results in $out"

#!/usr/bin/env bash
# The engine's host share between decode steps, and what async scheduling hides of it, without a GPU:
# `kestrel serve --fake-engine --fake-step-us STEP` (a modelled device taking STEP µs a step, fake_executor.h)
# with and without --async-scheduling, `kestrel bench` at each concurrency (greedy, --ignore-eos, 64 in / 256 out),
# two rounds alternated. The synchronous TPOT less STEP is the host's share per step (scheduling, events, the
# sinks, the HTTP side's wake-ups); with the flag it should be STEP.
#   bench/engine_async_ab.sh [STEP_US=540] [CONCURRENCY...=1 8]
# Above ~8 concurrent requests the fake's own token draws (N(0, 2) logits over the vocabulary, ~20 µs a row on
# the host) outgrow a 540 µs step and the fake itself is what is measured.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-540}
shift $(( $# > 0 ? 1 : 0 ))
levels=("$@")
[ ${#levels[@]} -eq 0 ] && levels=(1 8)
model=${MODEL:-build/testdata/nano}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; [ -n "${srv:-}" ] && kill "$srv" 2>/dev/null || true' EXIT
for round in 1 2; do
  for mode in sync async; do
    port=$((18300 + RANDOM % 500))
    ./build/src/cli/kestrel serve --fake-engine --model "$model" --port "$port" --max-num-seqs 64 \
      --fake-step-us "$step" $([ "$mode" = async ] && echo --async-scheduling) >"$tmp/serve.log" 2>&1 &
    srv=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
    for c in "${levels[@]}"; do
      ./build/src/cli/kestrel bench --base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len 64 \
        --output-len 256 --ignore-eos --num-prompts $(( c * 4 > 8 ? c * 4 : 8 )) --max-concurrency "$c" \
        --num-warmups 1 --no-progress --result-file "$tmp/r.json" >"$tmp/bench.log" 2>&1
      python3 -c "
import json; r = json.load(open('$tmp/r.json'))
print('round $round $mode c=$c: TPOT median {:.3f} ms, {:.0f} output tok/s'.format(r['median_tpot_ms'], r['output_throughput']))"
    done
    echo "  $(curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kestrel:ahead_steps_total' || true)"
    kill "$srv"; wait "$srv" 2>/dev/null || true; srv=
  done
done

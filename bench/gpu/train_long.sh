#!/usr/bin/env bash
# Long-context stage of k3-tiny on the H200 (issue #15 point 6; train/README.md "Long-context stage"), one device
# call: train from models/k3-tiny on long rows, export to $OUT/model, then measure the export through the engine.
# Called by `bench/gpu/run.sh train_long` (which unpacks .gpu-carry/ and exports wait_healthy), from the repo root.
#
#   TL_TRAIN_SECONDS  training time (default 270; the LR schedule runs on it)
#   TL_DEADLINE       the whole call, training included (default 560): every eval step is cut at it, so the
#                     device tool's 600 s limit still returns what was measured
#   TL_SEQ, TL_BATCH  row length and rows per step (16384 × 2: ~90 GB estimated, see train/README.md; rows of
#                     32K and more want TL_TRAIN_ARGS="--q-chunk 4096 --recompute": the MLA layers' O(T²) tensors
#                     per chunk of queries, the other sublayers recomputed in the backward pass)
#   TL_TRAIN_ARGS     more trainer flags (e.g. "--train-only indexer", "--kl-target selected", "--kda-forget 0.7")
#   TL_INIT           the model to start from (default models/k3-tiny; a path inside the checkout: train/ reads ../TL_INIT)
#   TL_1M_DEPTHS      depths of the 1M-token prompts (default 0,0.5,1: ~40 s of prefill each)
#   TL_SKIP_TRAIN=1   measure TL_INIT itself (a baseline run of the same evals)
#   TL_DEVICE         the servers' device (default cuda; cpu for a dry run of the flow)
# $OUT: model/ (the export: 2 shards + index, config, tokenizer files), summary.txt, logs.tgz (8 files in all).
set -uo pipefail
out="${OUT:-/tmp/tl_out}"
mkdir -p "$out"
t0=$(date +%s)
end=$(( t0 + ${TL_DEADLINE:-560} ))
left() { echo $(( end - $(date +%s) > 1 ? end - $(date +%s) : 1 )); }
since() { echo $(( $(date +%s) - t0 )); }
logs=/tmp/tl_logs
work=/tmp/tl_work
rm -rf "$logs" "$work" && mkdir -p "$logs" "$work/sets" "$work/sets1m" "$work/short"
kestrel="${KESTREL_BIN:-.gpu-carry/kestrel}"
if ! ldd "$kestrel" | grep -q "libcublasLt.so.13 => /"; then
  d="$(dirname "$(find / -name 'libcublasLt.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")"
  export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/machine.txt"

# Eval sets, made here on the CPU while the GPU trains (seeds ≥ 1,000,000, as every eval set): the grid
# 8K..128K × 5 depths × 1, the 1M prompts, and the kept skills trimmed to what the time allows.
(
  cd train || exit 1
  nice python3 -m k3data.make_eval --out "$work/sets" --min-context 8192 --max-context 131072 --passkey-reps 1 \
    --tools 0 --arith 0 --chat 0
  nice python3 -m k3data.make_eval --out "$work/sets1m" --min-context 1048576 --max-context 1048576 \
    --passkey-reps 1 --depths "${TL_1M_DEPTHS:-0,0.5,1}" --tools 0 --arith 0 --chat 0
) >"$logs/make_eval.log" 2>&1 &
sets_pid=$!
cp models/k3-tiny/eval/passkey.jsonl "$work/short/passkey-1k4k.jsonl"         # 1K, 2K, 4K × 5 depths
head -n "${TL_TOOLS:-60}" models/k3-tiny/eval/tool.jsonl > "$work/short/tool.jsonl"   # every 4th is no-fit
awk "NR % ${TL_ARITH_EVERY:-5} == 1" models/k3-tiny/eval/arith.jsonl > "$work/short/arith.jsonl"  # all efforts

model="${TL_INIT:-models/k3-tiny}"
if [ "${TL_SKIP_TRAIN:-0}" != 1 ]; then
  ts="${TL_TRAIN_SECONDS:-270}"
  # shellcheck disable=SC2086  # TL_TRAIN_ARGS: extra flags, word-split on purpose
  (cd train && timeout $(( ts + 150 )) python3 -m k3train.train --out "$work/run" --init-from "../${TL_INIT:-models/k3-tiny}" \
    --seq "${TL_SEQ:-16384}" --batch "${TL_BATCH:-2}" --long-frac "${TL_LONG_FRAC:-0.5}" --long-min "${TL_LONG_MIN:-4096}" \
    --mix-len 2048 --dense-frac 0 --kl-target dense --lr "${TL_LR:-3e-4}" --warmup 20 --total-seconds "$ts" \
    --time-budget "$ts" --workers 12 --log-every 10 ${TL_TRAIN_ARGS:-}) 2>&1 | tee "$logs/train.log" | grep -vE '^\{' || true
  grep -E '^\{' "$logs/train.log" | tail -3
  if [ -f "$work/run/model/config.json" ]; then
    cp -r "$work/run/model" "$out/model"      # the export only: resume/ (3 × ≤15 MiB masters) would pass 8 files
    model="$out/model"
  else
    echo "train_long: no export (see train.log); measuring ${TL_INIT:-models/k3-tiny}" | tee -a "$logs/summary_head.txt"
  fi
  echo "trained and exported at $(since) s"
fi
wait "$sets_pid" || echo "train_long: make_eval failed" | tee -a "$logs/summary_head.txt"

# Two servers side by side (memory is no issue: 8G + 4G of 141 GB): the 1M-token one (~40 s of prefill per
# prompt) and the grid + kept skills one.
"$kestrel" serve --device "${TL_DEVICE:-cuda}" --model "$model" --port 18131 --max-num-seqs 4 --max-model-len 1056768 \
  --memory-budget 8G >"$logs/serve_1m.log" 2>&1 &
srv1=$!
"$kestrel" serve --device "${TL_DEVICE:-cuda}" --model "$model" --port 18132 --max-num-seqs 8 --max-model-len 133120 \
  --memory-budget 4G >"$logs/serve.log" 2>&1 &
srv2=$!
trap 'kill $srv1 $srv2 2>/dev/null || true' EXIT
(
  wait_healthy 18131 "$srv1" || { echo "1M server did not come up"; exit 0; }
  timeout "$(left)" python3 bench/gpu/passkey_long.py --base-url http://127.0.0.1:18131 --set "$work/sets1m/passkey.jsonl" \
    >"$logs/passkey_1m.log" 2>&1
  echo "1M done at $(since) s"
) &
p1=$!
(
  wait_healthy 18132 "$srv2" || { echo "server did not come up"; exit 0; }
  for f in "$work/sets/passkey.jsonl" "$work/short/passkey-1k4k.jsonl" "$work/short/tool.jsonl" "$work/short/arith.jsonl"; do
    b="$(basename "$f" .jsonl)"
    [ "$b" = passkey ] && b=passkey-8k128k
    timeout "$(left)" "$kestrel" eval --set "$f" --base-url http://127.0.0.1:18132 --concurrency 8 --no-progress \
      --save-responses --out "$logs/engine-$b.json" >"$logs/engine-$b.txt" 2>&1 || echo "$b cut off or failed"
    echo "$b done at $(since) s"
  done
) &
p2=$!
wait $p1 $p2
kill $srv1 $srv2 2>/dev/null; wait $srv1 $srv2 2>/dev/null

{
  cat "$logs/summary_head.txt" 2>/dev/null
  if [ "${TL_SKIP_TRAIN:-0}" = 1 ]; then echo "model: $model (not trained: TL_SKIP_TRAIN)"; else
    echo "model: $model; training: ${TL_TRAIN_SECONDS:-270} s, seq ${TL_SEQ:-16384} × ${TL_BATCH:-2}, ${TL_TRAIN_ARGS:-}"; fi
  grep -E '^\{' "$logs/train.log" 2>/dev/null | awk 'NR % 8 == 1' | cut -c1-200; grep -E '^\{' "$logs/train.log" 2>/dev/null | tail -1
  grep -hE "params|trainable|saved step|Error|error" "$logs/train.log" 2>/dev/null | head -6
  for b in passkey-8k128k passkey-1k4k tool arith; do
    echo "## $b"; grep -vE "^\s*$" "$logs/engine-$b.txt" 2>/dev/null | tail -12
  done
  echo "## 1M"; cat "$logs/passkey_1m.log" 2>/dev/null
  echo "total $(since) s"
} > "$out/summary.txt"
cat "$out/summary.txt"
tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null

#!/usr/bin/env bash
# The CPU twin's ENGINE across processes (issue #16, docs/parallel.md §1): `kestrel generate --device cpu
# --tensor-parallel-size 2` as two processes under mpirun — rank 0 schedules, samples and broadcasts each
# step's StepPlan, rank 1 executes it (runtime/executor_mpi.h) — must give what the in-process TP2 run (two
# rank threads) gives. Both backends reduce in rank order (parallel/comm.h), so the logits are the same bytes
# (checked at the forward level by mpi_tp_np2); here, through the whole engine: three sampled prompts run
# together (batched steps; the 80-token one is prefilled in chunks beside the others' decodes), the same
# tokens and the same logprobs of each sampled token and its top 3 alternatives.
# Usage: mpi_generate_np2.sh KESTREL MPIEXEC NANO_DIR
set -euo pipefail
kestrel=$1 mpiexec=$2 model=$3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf 'ids:%s\nids:%s\nids:%s\n' "$(seq -s, 3 7 556)" "$(seq -s, 900 -11 300)" "$(seq -s, 1 1 9)" >"$out/prompts"
args=(generate --model "$model" --device cpu --tensor-parallel-size 2 --threads 1 --ignore-eos --block-size 16
      --memory-budget 16M --prompts-file "$out/prompts" --max-tokens 5 --temperature 0.8 --top-k 40 --seed 7
      --logprobs 3 --max-num-batched-tokens 32)
"$kestrel" "${args[@]}" >"$out/threads.txt"
"$mpiexec" --allow-run-as-root --oversubscribe --bind-to none -np 2 "$kestrel" "${args[@]}" >"$out/procs.txt" ||
  { echo "FAIL: mpirun exited with an error"; cat "$out/procs.txt"; exit 1; }
pick() { grep -E '^\[[0-9]+\] (tokens|logprobs):' "$1"; }
pick "$out/threads.txt" >"$out/t" && pick "$out/procs.txt" >"$out/p"
[ "$(grep -c 'tokens:' "$out/t")" = 3 ] && [ "$(grep -c 'logprobs:' "$out/t")" = 15 ] ||
  { echo "FAIL: expected 3 requests of 5 tokens"; cat "$out/threads.txt"; exit 1; }
diff "$out/t" "$out/p" || { echo "FAIL: tokens or logprobs differ (threads vs processes)"; exit 1; }
echo "mpi generate np2: 3 requests, 15 sampled tokens and their logprobs equal"; grep 'tokens:' "$out/p"

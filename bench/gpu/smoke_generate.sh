#!/usr/bin/env bash
# kestrel generate on the GPU vs the CPU (nano, made by run.sh serving): greedy single prompt,
# several prompts, sampled, graphs off, quantised caches (FP8 latent + keys, F16 KDA state). Run on the GPU machine from the
# folder that holds .gpu-carry/ (argument; default the repository root), pkg.tar.xz unpacked (bench/gpu/run.sh test does it).
set -uo pipefail
c="${1:-.}"
export LD_LIBRARY_PATH="$PWD/$c/.gpu-carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
k="$c/.gpu-carry/kestrel"
m=/tmp/kestrel_ckpt/nano
printf 'ids:1,2,3,4,5\nids:7,8,9\nids:100,200,300,400,500,600,700,800,900,10,11,12,13,14,15,16,17,18,19,20\n' > /tmp/p.txt
for d in cpu cuda; do
  echo "== $d greedy"; $k generate --model $m --prompt-tokens 1,2,3,4,5 --max-tokens 16 --ignore-eos --device $d | grep -E "tokens:|decode"
  echo "== $d 3 prompts"; $k generate --model $m --prompts-file /tmp/p.txt --max-tokens 12 --ignore-eos --device $d | grep -E "tokens:|requests"
  echo "== $d sampled T=0.8 top_p=0.9 seed 5"; $k generate --model $m --prompt-tokens 1,2,3,4,5 --max-tokens 12 --ignore-eos --temperature 0.8 --top-p 0.9 --seed 5 --device $d | grep -E "tokens:"
done
echo "== cuda --no-cuda-graphs"; $k generate --model $m --prompts-file /tmp/p.txt --max-tokens 12 --ignore-eos --device cuda --no-cuda-graphs | grep -E "tokens:"
echo "== cuda fp8 caches + f16 state"; $k generate --model $m --prompt-tokens 1,2 --max-tokens 2 --device cuda --kv-cache-dtype fp8 --index-cache-dtype fp8 --kda-state-dtype f16 2>&1 | tail -1

#!/usr/bin/env bash
# CPU engine-loop throughput with 1, 4 and 16 concurrent requests (default: the nano checkpoint).
#   bench/engine_throughput.sh [CKPT_DIR] [PROMPT_LEN] [NEW_TOKENS] [CONCURRENCY...]
# Each request gets its own fixed pseudo-random prompt (no shared prefix, so the prefix cache plays
# no part) and generates exactly NEW_TOKENS tokens greedily (--ignore-eos). All requests are
# submitted at once; the engine runs up to CONCURRENCY of them per step. Prints the kestrel summary line.
set -euo pipefail
dir=${1:-build/testdata/nano}
n=${2:-64}
new=${3:-64}
shift $(( $# > 3 ? 3 : $# ))
levels=("$@")
[ ${#levels[@]} -eq 0 ] && levels=(1 4 16)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for c in "${levels[@]}"; do
  python3 -c "
import random
for r in range($c):
    rng = random.Random(1000 + r)
    print('ids:' + ','.join(str(rng.randrange(768)) for _ in range($n)))" > "$tmp/prompts.txt"
  # One request alone takes the single-prompt output path; run two back to back instead (1 at a time).
  [ "$c" -eq 1 ] && python3 -c "print(open('$tmp/prompts.txt').read().strip())" >> "$tmp/prompts.txt"
  out=$(./build/src/cli/kestrel generate --model "$dir" --prompts-file "$tmp/prompts.txt" --max-tokens "$new" \
        --ignore-eos --no-prefix-cache --quiet --max-num-seqs "$c")
  echo "concurrency $c: $(grep '^requests:' <<<"$out")"
done

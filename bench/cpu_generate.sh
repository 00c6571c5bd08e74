#!/usr/bin/env bash
# CPU generate throughput on a checkpoint (default: the nano test checkpoint).
#   bench/cpu_generate.sh [CKPT_DIR] [PROMPT_LEN] [NEW_TOKENS]
# Prompt ids are a fixed arithmetic sequence inside the nano byte range, so runs are comparable.
set -euo pipefail
dir=${1:-build/testdata/nano}
n=${2:-128}
new=${3:-128}
prompt=$(python3 -c "print(','.join(str((i*37)%768) for i in range($n)))")
./build/src/cli/kestrel generate --model "$dir" --prompt-tokens "$prompt" --max-tokens "$new"

#!/usr/bin/env bash
# The README's first command: install what is missing, build, and run kestrel on the embedded
# default model. Until the trained default model ships, the default is the `nano` random-weight
# checkpoint, generated on first use into models/nano (it proves the pipeline, not the prose).
#   KESTREL_MODEL=DIR  use another checkpoint directory
#   extra arguments are passed to `kestrel generate`
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh >/dev/null
model="${KESTREL_MODEL:-models/nano}"
if [ ! -f "$model/config.json" ]; then
  echo "generating the nano checkpoint into $model"
  .venv/bin/python reference/make_checkpoint.py --config nano --out "$model" --seed 1
fi
./build/src/cli/kestrel inspect "$model" | tail -n 12
exec ./build/src/cli/kestrel generate --model "$model" --prompt "${KESTREL_PROMPT:-The quick brown fox}" \
  --max-tokens 32 "$@"

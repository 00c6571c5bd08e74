#!/usr/bin/env bash
# The README's first command: install what is missing, build, and start `kestrel serve` (the
# OpenAI-compatible server on the paged engine) on the embedded default model, printing how to query
# it. Until the trained default model ships, the default is the `nano` random-weight checkpoint,
# generated on first use into models/nano (it proves the pipeline, not the prose).
#   KESTREL_MODEL=DIR  use another checkpoint directory
#   KESTREL_PORT=N     listen on this port (default 8000)
#   extra arguments are passed to `kestrel serve` (e.g. --memory-budget 2G --max-num-seqs 32)
# Ctrl-C stops the server (it drains running requests first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh >/dev/null
model="${KESTREL_MODEL:-models/nano}"
port="${KESTREL_PORT:-8000}"
if [ ! -f "$model/config.json" ]; then
  echo "generating the nano checkpoint into $model"
  .venv/bin/python reference/make_checkpoint.py --config nano --out "$model" --seed 1
fi
name="$(basename "$model")"
# Printed before the server starts: `kestrel serve` itself prints a curl line once the model is loaded.
cat <<EOF
kestrel serve on $model, model name '$name', at http://127.0.0.1:$port
query it (streamed, with the reasoning as reasoning_content deltas):
  curl -N http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$name", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64, "stream": true}'
or from Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:$port/v1", api_key="unused")
  r = client.chat.completions.create(model="$name", messages=[{"role": "user", "content": "Hello"}], max_tokens=64)
  print(r.choices[0].message.model_extra.get("reasoning_content"), r.choices[0].message.content)
EOF
exec ./build/src/cli/kestrel serve --model "$model" --served-model-name "$name" --port "$port" "$@"

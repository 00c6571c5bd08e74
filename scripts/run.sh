#!/usr/bin/env bash
# The README's first command: install what is missing, build, and start `kestrel serve` (the
# OpenAI-compatible server on the paged engine) on the embedded default model, printing how to query
# it. The default is models/k3-tiny, the small trained K3.1 model that ships in the repository
# (models/k3-tiny/README.md: it knows passkey retrieval, tool calls, arithmetic and small talk).
#   KESTREL_MODEL=DIR  use another checkpoint directory (KESTREL_MODEL=models/nano: the random-weight
#                      test checkpoint, generated on first use)
#   KESTREL_PORT=N     listen on this port (default 8000)
#   extra arguments are passed to `kestrel serve` (e.g. --memory-budget 2G --max-num-seqs 32)
# Ctrl-C stops the server (it drains running requests first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh kestrel >/dev/null  # the server alone: a first start does not compile the test suites
model="${KESTREL_MODEL:-models/k3-tiny}"
port="${KESTREL_PORT:-8000}"
if [ ! -f "$model/config.json" ]; then
  [ "$(basename "$model")" = nano ] || { echo "error: $model/config.json not found" >&2; exit 1; }
  echo "generating the nano checkpoint into $model"
  .venv/bin/python reference/make_checkpoint.py --config nano --out "$model" --seed 1
fi
name="$(basename "$model")"
# Printed before the server starts: `kestrel serve` itself prints a curl line once the model is loaded.
cat <<EOF
kestrel serve on $model, model name '$name', at http://127.0.0.1:$port
query it: a tool call, streamed (the reasoning arrives as reasoning_content deltas, then tool_calls deltas):
  curl -N http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "$name",
    "messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "stream": true,
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]}'
or from Python (pip install openai), a word problem with visible reasoning:
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:$port/v1", api_key="unused")
  r = client.chat.completions.create(model="$name", reasoning_effort="high", max_tokens=300, messages=[{"role": "user",
      "content": "Sam has 4 books. Then Sam gets 3 more. How many books does Sam have now?"}])
  print(r.choices[0].message.model_extra.get("reasoning_content"), "->", r.choices[0].message.content)
EOF
exec ./build/src/cli/kestrel serve --model "$model" --served-model-name "$name" --port "$port" "$@"

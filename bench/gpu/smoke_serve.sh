#!/usr/bin/env bash
# kestrel serve --device cuda on nano: health, a completion, a streamed chat completion, metrics; and
# generate with --gpu-memory-utilization (the device-memory budget path). Run on the GPU machine from
# the folder that holds .gpu-carry/ (argument; default the repository root), pkg.tar.xz unpacked (bench/gpu/run.sh test does it).
set -uo pipefail
c="${1:-.}"
export LD_LIBRARY_PATH="$PWD/$c/.gpu-carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
k="$c/.gpu-carry/kestrel"
m=/tmp/kestrel_ckpt/nano
[ -f $m/config.json ] || python3 "$c/reference/make_checkpoint.py" --config nano --out $m --seed 1 --no-vision >/dev/null
$k generate --model $m --prompt-tokens 1,2,3,4,5 --max-tokens 8 --ignore-eos --device cuda --gpu-memory-utilization 0.5 | grep -E "capacity|tokens:"
$k serve --model $m --device cuda --port 8123 --max-num-seqs 8 --served-model-name nano > /tmp/serve.log 2>&1 &
pid=$!
python3 - <<'PY'
import json, time, urllib.request
base = "http://127.0.0.1:8123"
for _ in range(200):
    try:
        if urllib.request.urlopen(base + "/health", timeout=1).status == 200: break
    except Exception: time.sleep(0.1)
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=30).read().decode()
r = json.loads(post("/v1/completions", {"model": "nano", "prompt": "Hello world", "max_tokens": 8, "temperature": 0}))
print("completion:", repr(r["choices"][0]["text"]), r["usage"])
s = post("/v1/chat/completions", {"model": "nano", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                   "stream": True, "temperature": 0.7, "seed": 3})
print("stream chunks:", s.count("data: "), "ends with [DONE]:", s.strip().endswith("[DONE]"))
m = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
print("metrics:", [l for l in m.splitlines() if l.startswith("vllm:generation_tokens_total")][:1])
PY
kill $pid; wait $pid 2>/dev/null
grep -E "capacity|ready|error" /tmp/serve.log | head -5

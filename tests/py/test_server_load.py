"""Load test of `kestrel serve` on loopback with the nano CPU model: hundreds of concurrent SSE
streams (chat and completions), a quarter of them dropped by the client mid-stream. Bounded in count
and time. Every stream that completes must be well-formed OpenAI SSE ending in [DONE]; 429s (bounded
queue) are allowed and counted; afterwards the server is healthy and /metrics shows no running or
waiting request and no KV page held (dropped streams gave theirs back)."""
import asyncio
import json
import random
import time

import httpx

from serve_util import Server

STREAMS = 300
DEADLINE_S = 90


async def one(client, url, i, rng, results):
    chat = i % 5 == 0
    body = {"model": "nano", "max_tokens": rng.randint(2, 8), "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"hi {i}"}]
    else:
        body["prompt"] = f"p{i}"
    drop_after = rng.randint(1, 3) if rng.random() < 0.25 else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code == 429:
                results["429"] += 1
                await r.aread()
                return
            assert r.status_code == 200, r.status_code
            events = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                events.append(line[6:])
                if drop_after is not None and len(events) >= drop_after:
                    results["dropped"] += 1
                    return  # leaving the context manager closes the connection mid-stream
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
        assert finishes in (["length"], ["stop"], ["tool_calls"]), finishes
        results["ok"] += 1
    except Exception as e:  # noqa: BLE001 - collected and reported below
        results["errors"].append(f"{i}: {e!r}")


async def run_load(url):
    rng = random.Random(7)
    results = {"ok": 0, "dropped": 0, "429": 0, "errors": []}
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, url, i, rng, results) for i in range(STREAMS))),
                               timeout=DEADLINE_S)
    return results


def test_hundreds_of_streams_with_disconnects(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--served-model-name", "nano", "--max-model-len", "1024",
               "--max-num-seqs", "32", "--max-queue", "400")
    try:
        t0 = time.time()
        results = asyncio.run(run_load(s.url))
        elapsed = time.time() - t0
        assert not results["errors"], results["errors"][:5]
        assert results["ok"] + results["dropped"] + results["429"] == STREAMS
        assert results["ok"] >= STREAMS // 2 and results["dropped"] > 0, results
        assert s.health() == 200
        deadline = time.time() + 10
        while True:
            m, _ = s.metrics()
            idle = (m['vllm:num_requests_running{model_name="nano"}'] == 0 and
                    m['vllm:num_requests_waiting{model_name="nano"}'] == 0 and
                    m['kestrel:kv_pages_used{model_name="nano"}'] == 0)
            if idle or time.time() > deadline:
                break
            time.sleep(0.1)
        assert idle, m
        assert m['vllm:kv_cache_usage_perc{model_name="nano"}'] == 0
        print(f"load: {results['ok']} complete, {results['dropped']} dropped, {results['429']} refused "
              f"in {elapsed:.1f} s")
    finally:
        assert s.stop() == 0

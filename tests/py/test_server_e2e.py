"""End-to-end tests of `kestrel serve` on the nano checkpoint, driven by the official openai client
(streaming and not, tools, reasoning fields, usage, errors) and by raw HTTP for malformed input.
The nano weights are random, so the text is noise: the tests check shapes and semantics, not meaning."""
import json
import re
import signal
import socket
import time

import httpx
import openai
import pytest

from serve_util import Server

MODEL = "nano"
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--max-model-len", "2048",
               "--max-num-seqs", "4", "--max-request-bytes", "65536")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(server, client):
    assert server.health() == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 2048


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.role == "assistant"
    extra = c.message.model_extra
    assert "reasoning_content" in extra and "reasoning" in extra  # thinking is on by default
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.completion_tokens_details.reasoning_tokens <= u.completion_tokens
    # Greedy is deterministic.
    r2 = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0)
    assert (r2.choices[0].message.content, r2.choices[0].message.model_extra["reasoning_content"]) == \
        (c.message.content, extra["reasoning_content"])


def test_chat_streaming_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    # The stream carries the same reasoning/content as the non-streaming answer.
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=0)
    assert reasoning == (r.choices[0].message.model_extra["reasoning_content"] or "")
    assert content == (r.choices[0].message.content or "")


def test_reasoning_effort_and_thinking_off(client):
    for effort in ("low", "high", "max"):
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, reasoning_effort=effort)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert not r.choices[0].message.model_extra.get("reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, reasoning_effort="extreme")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_and_multi_turn_history(client):
    for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=6)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for call in r.choices[0].message.tool_calls or []:
            assert call.type == "function" and call.id
    history = MSG + [
        {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=6,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError):  # named tool that is not declared
        client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_sampling_params_seed_n_logprobs(client):
    kw = dict(model=MODEL, messages=MSG, max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "min_p": 0.01})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message == b.choices[0].message
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, n=2, logprobs=True, top_logprobs=3,
                                       presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs.content
        assert 1 <= len(lp) <= 5
        for t in lp:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob


def test_completions_and_stop_string(client):
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    text = r.choices[0].text
    assert r.usage.completion_tokens == 16
    # A stop string cut out of the greedy text ends the completion right before it.
    mid = text[len(text) // 2:len(text) // 2 + 2]
    if mid.strip() and "\ufffd" not in mid:
        s = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                      stop=[mid], extra_body={"ignore_eos": True})
        assert s.choices[0].finish_reason == "stop"
        assert s.choices[0].text == text[:text.index(mid)]
        streamed = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16,
                                                  temperature=0, stop=[mid], stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in streamed) == s.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True, logprobs=2,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == 3
    assert any(c.choices and c.choices[0].logprobs for c in chunks)


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    d = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert d.json()["prompt"] == "hello world"
    c = httpx.post(server.url + "/tokenize", json={"messages": MSG})
    assert c.status_code == 200 and c.json()["count"] > 0
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-1]}).status_code == 400


def test_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MSG, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, temperature="hot")
    assert "temperature" in str(e.value)
    for bad in ({"max_tokens": -1}, {"top_p": 2}, {"n": "2"}, {"stop": 5}, {"messages": []},
                {"messages": [{"content": "no role"}]}, {"messages": "hi"}):
        body = {"model": MODEL, "messages": MSG, **bad}
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    with pytest.raises(openai.BadRequestError) as e:  # context too long
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=2)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2100)


def test_raw_http_malformed(server):
    def status(resp):
        return int(resp.split(b" ", 2)[1])
    post = lambda body, extra=b"": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra +
                                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    r = server.raw(post(b"{not json"))
    assert status(r) == 400 and json.loads(r.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert status(server.raw(post(b"[1, 2]"))) == 400
    assert status(server.raw(post(b"\xff\xfe garbage"))) == 400
    assert status(server.raw(post(b"x" * 70000))) == 413
    assert status(server.raw(b"NONSENSE\r\n\r\n")) == 400
    assert status(server.raw(b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n")) == 431
    assert status(server.raw(b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) == 405
    # Truncated body then close; binary noise; a half header: none of it may hurt the server.
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\"")
    assert status(server.raw(bytes(range(256)) * 4, timeout=5)) == 400
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
    # Keep-alive: two requests on one connection.
    two = server.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert two.count(b"HTTP/1.1 200 OK") == 2
    assert server.health() == 200


def metric(m, name):
    return m[name + '{model_name="nano"}']


def test_disconnect_cancels_and_metrics(server):
    m0, _ = server.metrics()
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "go", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(g.startswith("data: ") for g in got)
            # Mid-stream the request holds a state slot and KV pages (so "back to zero" below means something).
            mid, _ = server.metrics()
            assert metric(mid, "vllm:num_requests_running") == 1 and metric(mid, "kestrel:kv_pages_used") >= 1
    deadline = time.time() + 5
    while True:
        m, text = server.metrics()
        running = metric(m, "vllm:num_requests_running")
        if running == 0 or time.time() > deadline:
            break
        time.sleep(0.05)
    # Everything the cancelled request held is back: no running or waiting request, no page held.
    assert running == 0 and metric(m, "vllm:num_requests_waiting") == 0
    assert metric(m, "kestrel:kv_pages_used") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0
    aborted = 'vllm:request_success_total{model_name="nano",finished_reason="abort"}'
    assert m[aborted] - m0.get(aborted, 0) == 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total"):
        assert name in text, name


def test_prefix_cache_hit_for_a_repeated_prompt(server, client):
    # 300 prompt tokens = two full 128-token blocks + a tail: the second request reuses both blocks.
    prompt = [(i * 7) % 700 + 3 for i in range(300)]
    m0, _ = server.metrics()
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    b = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    m1, _ = server.metrics()
    cached = [r.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] for r in (a, b)]
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == 300
    assert cached[0] == 0 and cached[1] == 256, cached
    assert a.choices[0].text == b.choices[0].text  # the cached prefix gives the same logits
    queries = metric(m1, "vllm:prefix_cache_queries_total") - metric(m0, "vllm:prefix_cache_queries_total")
    hits = metric(m1, "vllm:prefix_cache_hits_total") - metric(m0, "vllm:prefix_cache_hits_total")
    assert queries == 600 and hits == 256, (queries, hits)
    # Cached prefix pages nobody reads are reclaimable: idle means no page in use.
    assert metric(m1, "kestrel:kv_pages_used") == 0 and metric(m1, "vllm:num_requests_running") == 0


def test_memory_budget_bounds_max_model_len(kestrel_bin, nano_dir):
    # A small budget: max_model_len defaults to the longest request the memory plan holds, printed at start.
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--memory-budget", "24M", "--max-num-seqs", "2",
               "--block-size", "16")
    try:
        out = s.output(until="try: curl")
        m = re.search(r"longest single request (\d+) tokens", out)
        assert m and "concurrent requests" in out and "try: curl" in out, out
        longest = int(m.group(1))
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["max_model_len"] == longest
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": longest + 1})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        ok = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert s.stop() == 0
    # Asking for more context than the budget can hold is refused at start, with the reason.
    bad = Server(kestrel_bin, nano_dir, "--memory-budget", "24M", "--max-num-seqs", "2", "--block-size", "16",
                 "--max-model-len", str(longest * 2), wait_ready=False)
    assert bad.proc.wait(timeout=30) == 1
    assert "raise --memory-budget" in bad.output(until="raise --memory-budget")
    bad.stop()


def test_api_key(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--api-key", "sekrit", "--fake-engine")
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(s.url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
        assert s.health() == 200  # probes need no key
    finally:
        assert s.stop() == 0


def test_health_503_while_loading_and_sigterm_drains(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--fake-load-ms", "1500", "--fake-delay-ms", "20",
               wait_ready=False)
    try:
        assert s.health() == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]
        s.wait_healthy()
        # A stream in flight when SIGTERM arrives still ends properly ([DONE]); then exit 0.
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 20, "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                next(lines)
                s.proc.send_signal(signal.SIGTERM)
                rest = list(lines)
        assert "data: [DONE]" in rest
        assert s.proc.wait(timeout=15) == 0
    finally:
        s.stop()


def test_bounded_queue_answers_429(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--fake-delay-ms", "50", "--max-num-seqs", "1",
               "--max-queue", "1")
    try:
        with httpx.Client(timeout=30) as h:
            streams = [h.stream("POST", s.url + "/v1/completions",
                                json={"prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True})
                       for _ in range(4)]
            codes = []
            for st in streams:
                r = st.__enter__()
                codes.append(r.status_code)
            for st in streams:
                st.__exit__(None, None, None)
        assert codes.count(200) == 2 and codes.count(429) == 2, codes
        assert s.health() == 200
    finally:
        assert s.stop() == 0

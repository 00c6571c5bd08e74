"""The OpenAI surface, point by point (issue #23), on the nano checkpoint through the official openai
client or raw HTTP: parameters kestrel does not honour are refused with a 400 naming them;
logit_bias and min_tokens act; /v1/models/{id} and model aliases; completions echo with prompt
logprobs (lm-evaluation-harness's loglikelihood request), max_tokens 0, batched prompts;
reasoning_effort's whole range; special tokens never in text unless asked; continuous usage stats;
HTTP/1.1 pipelining; Retry-After; the access log; CORS; the Responses API. nano's weights are random,
so the tests force tokens with logit_bias where they need a known output."""
import json
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
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "4",
               "--allowed-origins", "http://app.example")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def special(nano_dir):
    """Special-token ids by name, from the checkpoint's tokenizer_config.json."""
    cfg = json.loads((nano_dir / "tokenizer_config.json").read_text())
    return {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}


def ids_of(server, text):
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def text_of(server, ids):
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


# ---- parameters: honoured or refused -------------------------------------------------------------

@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"logit_bias": [1]}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"user": 5}, "user"),
    ("/v1/chat/completions", {"model": None}, "model"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"guided_regex": "a+"}, "guided_regex"),
    ("/v1/completions", {"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
])
def test_unhonoured_parameters_are_refused_by_name(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": MSG} if "chat" in path else {"prompt": "hi"}), **extra}
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_refusal_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"guided_json": {}})
    assert e.value.body["param"] == "guided_json"
    # Accepted: user as a string, best_of equal to n, skip_special_tokens, the vLLM sampling extras.
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, user="u-1",
                                   extra_body={"skip_special_tokens": True, "top_k": 5, "min_p": 0.1})
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=1, n=1)


def test_logit_bias_forces_and_bans(server, client):
    x, y = ids_of(server, " apple")[0], ids_of(server, " river")[0]
    assert x != y
    both = {str(x): 100, str(y): 50}
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logit_bias=both)
    assert r.choices[0].text == text_of(server, [x] * 3)
    # −100 takes x out: y (next in line) everywhere; under sampling too.
    ban = {str(x): -100, str(y): 50}
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logit_bias=ban)
    assert r.choices[0].text == text_of(server, [y] * 3)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=1.0, seed=3,
                                       logit_bias=ban, extra_body={"reasoning_effort": "none"})
    assert r.choices[0].message.content == text_of(server, [y] * 4)


def test_min_tokens_holds_back_stop_ids(server, client):
    x = ids_of(server, " apple")[0]
    forced = {"logit_bias": {str(x): 100}, "stop_token_ids": [x]}
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=10, temperature=0, extra_body=forced)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=10, temperature=0,
                                  extra_body={**forced, "min_tokens": 4})
    # Four tokens without the stop id (it is held back whatever its bias), then the forced stop id.
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
    assert " apple" not in r.choices[0].text


# ---- models -------------------------------------------------------------------------------------

def test_models_retrieve_and_aliases(server, client, nano_dir):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    assert client.models.retrieve(nano_dir.name).id == MODEL       # the directory's name
    assert httpx.get(server.url + "/v1/models/" + str(nano_dir)).json()["id"] == MODEL  # the path given
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for name in (nano_dir.name, str(nano_dir)):
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == MODEL


# ---- completions: echo, prompt logprobs, max_tokens 0, batches ----------------------------------------

def test_echo_with_prompt_logprobs_is_lm_eval_loglikelihood(server, client):
    prompt = ids_of(server, "The quick brown fox jumps over the lazy dog")
    P = len(prompt)
    # lm-evaluation-harness local-completions: token ids, echo, logprobs 1, max_tokens 1, greedy.
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(text_of(server, prompt))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == P + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, P + 1):
        assert lp.token_logprobs[i] <= 0 and len(lp.top_logprobs[i]) >= 1
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == P and r.usage.completion_tokens == 1
    # Independent check of prompt position k: the logprob of prompt[k] given prompt[:k] is the raw
    # logprob the sampler reports when that token is forced after the prefix.
    for k in (1, P // 2, P - 1):
        g = client.completions.create(model=MODEL, prompt=prompt[:k], max_tokens=1, temperature=0, logprobs=1,
                                      logit_bias={str(prompt[k]): 100})
        assert g.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[k], abs=2e-4)
    # max_tokens 0: the prompt and its logprobs only.
    z = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert z.choices[0].text == text_of(server, prompt) and z.usage.completion_tokens == 0
    assert z.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:P], abs=2e-4)
    assert z.choices[0].finish_reason == "length"
    # Echo of a string prompt, streamed: the prompt first.
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", echo=True, max_tokens=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks).startswith("Hello")


def test_lm_eval_remote_tokenizer_and_batched_loglikelihood(server):
    """lm-evaluation-harness 0.4.13's local-completions, request for request (bench/RESULTS.md ran the real
    one): its tokenizer_backend "remote" probe (GET /tokenizer_info with an eos_token, POST /tokenize
    with add_special_tokens false), its encoding of context and continuation apart, then a batch of
    loglikelihood requests in one call, scored as it scores them: sum(token_logprobs[ctxlen:-1]) and
    is_greedy against top_logprobs."""
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert isinstance(info["eos_token"], str) and info["model_max_length"] > 0
    enc = lambda s: post(server, "/tokenize", {"prompt": s, "add_special_tokens": False}).json()["tokens"]
    assert enc("test") == ids_of(server, "test")
    assert httpx.post(server.url + "/detokenize", json={"tokens": enc("Answer: 7")}).json()["prompt"] == "Answer: 7"
    ctx = enc("Question: what is 3 + 4?\nAnswer:")
    conts = [enc(" 7"), enc(" 12"), enc(" seven")]
    batch = {"model": MODEL, "prompt": [ctx + c for c in conts], "temperature": 0, "max_tokens": 1, "logprobs": 1,
             "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", batch)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c, cont in zip(choices, conts):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1  # the prompt, then the one generated token
        scored = lp["token_logprobs"][len(ctx):-1]
        assert len(scored) == len(cont) and all(x <= 0 for x in scored)
        # The same sum from one request per continuation (the batch changes nothing).
        alone = post(server, "/v1/completions", {**batch, "prompt": ctx + cont}).json()["choices"][0]["logprobs"]
        assert sum(scored) == pytest.approx(sum(alone["token_logprobs"][len(ctx):-1]), abs=1e-3)
        for tok, top in zip(scored, lp["top_logprobs"][len(ctx):-1]):
            assert max(top.values()) >= tok - 1e-6  # is_greedy is well defined


# What langchain-openai 1.7's with_structured_output(Weather, method=...) sends, body for body (captured
# from the real client; bench/langchain_structured.py runs it against k3-tiny). The server must take
# all three; that the answer then conforms is grammar-constrained decoding's work (issue #20).
_WEATHER = {"description": "The weather report a user asked for.", "type": "object",
            "properties": {"city": {"description": "the city's name", "title": "City", "type": "string"},
                           "celsius": {"description": "the temperature in degrees Celsius", "title": "Celsius",
                                       "type": "integer"}},
            "required": ["city", "celsius"], "title": "Weather", "additionalProperties": False}
_LANGCHAIN = {
    "function_calling": {"parallel_tool_calls": False, "tool_choice": {"type": "function", "function": {"name": "Weather"}},
                         "tools": [{"type": "function", "function": {"name": "Weather", "description": _WEATHER["description"],
                                                                     "parameters": _WEATHER}}]},
    "json_mode": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"schema": _WEATHER, "name": "Weather", "strict": True}}},
}


@pytest.mark.parametrize("mode", sorted(_LANGCHAIN))
def test_langchain_structured_output_requests_are_accepted(server, mode):
    # max_tokens leaves room for the shortest complete JSON answer (below it the JSON modes are a 400 naming
    # max_tokens: docs/structured-outputs.md, "Finishing within max_tokens"); within it they must end as a
    # complete JSON object, which is what LangChain then parses.
    body = {"model": MODEL, "stream": False, "messages": [{"content": "hi", "role": "user"}], "temperature": 0.0,
            "max_tokens": 48, **_LANGCHAIN[mode]}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant" and (msg.get("content") is not None or msg.get("tool_calls"))
    if mode != "function_calling":
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(msg["content"]), dict), r.text


def test_max_tokens_zero_in_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=0)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    assert not r.choices[0].message.content and r.choices[0].finish_reason == "length"


def test_batched_prompts(server, client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye now"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL, prompt="Goodbye now", max_tokens=4, temperature=0)
    assert r.choices[2].text == r.choices[3].text == alone.choices[0].text
    assert r.usage.prompt_tokens == len(ids_of(server, "Hello")) + len(ids_of(server, "Goodbye now"))
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}


# ---- reasoning effort, special tokens, usage ----------------------------------------------------------

def test_reasoning_effort_range(server, client):
    def prompt(effort):
        return httpx.post(server.url + "/tokenize", json={"messages": MSG, "reasoning_effort": effort}).json()["tokens"]
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, reasoning_effort=effort)
        assert r.choices[0].finish_reason
    assert prompt("minimal") == prompt("low") and prompt("xhigh") == prompt("max")
    assert len({tuple(prompt(e)) for e in ("none", "low", "medium", "high", "max")}) == 5
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, reasoning_effort="none", temperature=0)
    assert not r.choices[0].message.model_extra.get("reasoning_content")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"reasoning_effort": "extreme"})


def test_special_tokens_never_in_text_unless_asked(client, special):
    close, open_ = special["<|close|>"], special["<|open|>"]
    kw = dict(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    r = client.completions.create(logit_bias={str(close): 100}, **kw)
    assert "<|" not in r.choices[0].text and r.usage.completion_tokens == 3
    r = client.completions.create(logit_bias={str(close): 100}, extra_body={"skip_special_tokens": False}, **kw)
    assert r.choices[0].text == "<|close|>" * 3
    # Chat output ending inside a marker (<|open|> with its header unfinished) or made of stray markers.
    for bias in ({str(open_): 100}, {str(close): 100}):
        for effort in ("high", "none"):
            c = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, temperature=0, logit_bias=bias,
                                               reasoning_effort=effort)
            msg = c.choices[0].message
            text = (msg.content or "") + (msg.model_extra.get("reasoning_content") or "")
            assert "<|" not in text, text
    c = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, temperature=0,
                                       logit_bias={str(close): 100}, reasoning_effort="none",
                                       extra_body={"skip_special_tokens": False})
    assert "<|close|>" in (c.choices[0].message.content or "")


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens <= 12
    assert all(c.usage is not None for c in chunks)


# ---- HTTP: pipelining, CORS, the log -------------------------------------------------------------------

def _http(method, path, body=None, headers=()):
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return (head + "".join(h + "\r\n" for h in headers) + "\r\n").encode() + data


def _responses(sock, n, timeout=30):
    """Reads n HTTP/1.1 responses (Content-Length or chunked) off a socket, in order."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536) or b""
        head, rest = buf.split(b"\r\n\r\n", 1)
        hl = head.decode().lower()
        if "transfer-encoding: chunked" in hl:
            while b"\r\n0\r\n\r\n" not in b"\r\n" + rest:
                rest += sock.recv(65536)
            end = (b"\r\n" + rest).index(b"\r\n0\r\n\r\n") + 5  # the terminator's end, in `rest`
            body, buf = rest[:end], rest[end:]
        else:
            length = int(hl.split("content-length: ")[1].split("\r\n")[0])
            while len(rest) < length:
                rest += sock.recv(65536)
            body, buf = rest[:length], rest[length:]
        out.append((int(head.split(b" ")[1]), head.decode(), body))
    return out


def test_http_pipelining_answers_in_order(server):
    reqs = [_http("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": k, "temperature": 0,
                                              "ignore_eos": True}) for k in (3, 1, 2)]
    reqs.insert(1, _http("GET", "/health"))
    stream = _http("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
    with socket.create_connection((server.host, server.port)) as s:
        t0 = time.time()
        s.sendall(b"".join(reqs) + stream)  # five requests in one write
        got = _responses(s, 5)
        assert time.time() - t0 < 20
    assert [g[0] for g in got] == [200] * 5
    tokens = [json.loads(g[2])["usage"]["completion_tokens"] for g in (got[0], got[2], got[3])]
    assert tokens == [3, 1, 2]
    assert b"[DONE]" in got[4][2]


def test_cors(server):
    origin = "http://app.example"
    pre = httpx.options(server.url + "/v1/chat/completions",
                        headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == origin
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.get(server.url + "/v1/models", headers={"Origin": origin})
    assert r.headers["access-control-allow-origin"] == origin
    r = httpx.post(server.url + "/v1/completions", headers={"Origin": origin},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1, "stream": True})
    assert r.headers["access-control-allow-origin"] == origin
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert httpx.options(server.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                              "Access-Control-Request-Method": "GET"}).status_code == 403


def test_access_log_lines(server):
    n0 = len(server.log_records())
    post(server, "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 3})
    post(server, "/v1/chat/completions", {"model": MODEL, "messages": MSG, "guided_json": {}})
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True}) as r:
        next(r.iter_lines())  # then leave mid-stream
    deadline = time.time() + 10
    while len(server.log_records()) < n0 + 3 and time.time() < deadline:
        time.sleep(0.05)
    recs = server.log_records()[n0:]
    ok = next(r for r in recs if r["route"] == "/v1/chat/completions" and r["status"] == 200)
    assert ok["id"].startswith("chatcmpl-") and ok["method"] == "POST"
    assert ok["prompt_tokens"] > 0 and 1 <= ok["completion_tokens"] <= 3
    assert ok["latency_ms"] > 0 and ok["client_disconnect"] is False and ok["level"] == "info"
    bad = next(r for r in recs if r["status"] == 400)
    assert "guided_json" in bad["error"] and bad["level"] == "warning"
    gone = next(r for r in recs if r["route"] == "/v1/completions")
    assert gone["client_disconnect"] is True and gone["completion_tokens"] < 500


def test_log_level_and_disable_access_log(kestrel_bin, nano_dir):
    for flags, expect in ((["--disable-access-log"], 0), (["--log-level", "error"], 0), (["--log-level", "debug"], 2)):
        s = Server(kestrel_bin, nano_dir, "--fake-engine", *flags)
        try:
            httpx.get(s.url + "/v1/models")
            httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            time.sleep(0.3)
            assert len([r for r in s.log_records() if r["route"] != "/health"]) == expect, flags
        finally:
            assert s.stop() == 0


def test_retry_after_on_429(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--fake-delay-ms", "50", "--max-num-seqs", "1", "--max-queue", "1")
    try:
        with httpx.Client(timeout=30) as h:
            streams = [h.stream("POST", s.url + "/v1/completions",
                                json={"prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True})
                       for _ in range(4)]
            answers = [st.__enter__() for st in streams]
            refused = [r for r in answers if r.status_code == 429]
            for st in streams:
                st.__exit__(None, None, None)
        assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert all("retry-after" not in r.headers for r in answers if r.status_code == 200)
    finally:
        assert s.stop() == 0


# ---- the Responses API ----------------------------------------------------------------------------------

def test_responses_text_reasoning_and_usage(client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, instructions="Be brief.",
                                reasoning={"effort": "high"}, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    kinds = [o.type for o in r.output]
    assert "message" in kinds and isinstance(r.output_text, str)
    # The same answer as chat completions over the same prompt (greedy): thinking is on, so the
    # reasoning comes first, as a reasoning item with reasoning_text content.
    c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, reasoning_effort="high",
                                       messages=[{"role": "system", "content": "Be brief."}] + MSG)
    assert r.output_text == (c.choices[0].message.content or "")
    reasoning = c.choices[0].message.model_extra.get("reasoning_content") or ""
    if reasoning:
        assert kinds[0] == "reasoning" and r.output[0].content[0].type == "reasoning_text"
        assert r.output[0].content[0].text == reasoning
    else:
        assert "reasoning" not in kinds


def test_responses_streaming_events(client):
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hello there"}],
                                          max_output_tokens=10, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "".join(c.text for o in final.output if o.type == "reasoning" for c in o.content)
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == len(final.output)


def test_responses_history_items_and_refusals(server, client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "12 C, rain"}]
    r = client.responses.create(model=MODEL, input=history, tools=tools, max_output_tokens=4,
                                text={"format": {"type": "json_object"}})
    assert r.status in ("completed", "incomplete") and r.tools[0].name == "get_weather"
    for extra, param in (({"previous_response_id": "resp_x"}, "previous_response_id"), ({"store": True}, "store"),
                         ({"tools": [{"type": "web_search"}]}, "tools"), ({"background": True}, "background"),
                         ({"reasoning": {"summary": "auto"}}, "reasoning")):
        resp = post(server, "/v1/responses", {"model": MODEL, "input": "hi", **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (extra, resp.text)
    # Errors found after the rewrite into a chat request name the Responses fields: a schema keyword of
    # text.format (a grammar compile), a prompt longer than the context (2048 tokens here), the budget.
    for extra, param, says in (
            ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "a"}}}},
             "text", "text.format schema"),
            ({"input": "hello " * 3000}, "input", "maximum context length"),
            ({"max_output_tokens": 10**7}, "max_output_tokens", "max_output_tokens")):
        resp = post(server, "/v1/responses", {"model": MODEL, "input": "hi", **extra})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == param and says in err["message"], (extra, resp.text)
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 404

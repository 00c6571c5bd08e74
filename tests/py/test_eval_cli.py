"""`kestrel eval` end to end.

Against a fake OpenAI endpoint (a small HTTP server in this file answering each item with a canned response of
known correctness): the exact scores, the grid and tables, error accounting (HTTP 500, a body that is not JSON,
nothing listening), the request bodies sent, and `--score-responses` reproducing the live scores from the saved
file. Against `kestrel serve` on the random-weight nano checkpoint: the pipeline, the JSON and table shape and
the error count (a request the server rejects), not accuracy."""
import http.server
import json
import re
import threading
import time

import pytest

from conftest import run_kestrel
from serve_util import Server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def item(id_, task, case, expect, meta, **req):
    return {"id": id_, "task": task, "expect": expect, "meta": meta,
            "request": {"messages": [{"role": "user", "content": f"case:{case}"}], "max_tokens": 16, **req}}


def msg(content="", finish="stop", reasoning="", calls=()):
    m = {"role": "assistant", "content": content or None, "reasoning_content": reasoning}
    if calls:
        m["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(calls)]
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": m, "finish_reason": finish}]}


# case -> (HTTP status, body)
CANNED = {
    "pk-a": (200, msg("The passkey is 48213.")),
    "pk-b": (200, msg("It might be 48213 or 11111")),            # last integer wrong
    "pk-c": (200, msg("Found: 7", reasoning="maybe 3")),
    "pk-d": (500, {"error": {"message": "boom"}}),
    "ar-a": (200, msg("12 + 30 = 42")),
    "ar-b": (200, msg("so -6")),                                   # expected 6
    "ar-c": (200, "this is not json"),
    "tl-ok": (200, msg(finish="tool_calls", calls=[("get_weather", '{"city": "Paris", "days": 2}')])),
    "tl-type": (200, msg(finish="tool_calls", calls=[("get_weather", '{"city": 5}')])),
    "tl-parse": (200, msg(finish="tool_calls", calls=[("get_weather", '{"city": "Par')])),
    "tl-stop": (200, msg("I will not call it")),                    # a call was expected
    "nf-ok": (200, msg("No tool fits.")),
    "nf-call": (200, msg(finish="tool_calls", calls=[("get_time", "{}")])),
    "chat": (200, msg("hello")),
}

SET = [
    item("pk-1024-0.25", "passkey", "pk-a", {"answer": "48213"}, {"context_tokens": 1024, "depth": 0.25}),
    item("pk-1024-0.75", "passkey", "pk-b", {"answer": "48213"}, {"context_tokens": 1024, "depth": 0.75}),
    item("pk-2048-0.25", "passkey", "pk-c", {"answer": "7"}, {"context_tokens": 2048, "depth": 0.25}),
    item("pk-2048-0.75", "passkey", "pk-d", {"answer": "7"}, {"context_tokens": 2048, "depth": 0.75}),
    item("ar-1", "arith", "ar-a", {"answer": "42"}, {"effort": "low", "digits": 2}, reasoning_effort="low"),
    item("ar-2", "arith", "ar-b", {"answer": "6"}, {"effort": "high", "digits": 1}, reasoning_effort="high"),
    item("ar-3", "arith", "ar-c", {"answer": "1"}, {"effort": "high", "digits": 1}, reasoning_effort="high"),
    item("tl-1", "tool", "tl-ok", {"call": True, "name": "get_weather"}, {"kind": "call"}, tools=[WEATHER, TIME]),
    item("tl-2", "tool", "tl-type", {"call": True, "name": "get_weather"}, {"kind": "call"}, tools=[WEATHER]),
    item("tl-3", "tool", "tl-parse", {"call": True, "name": "get_weather"}, {"kind": "call"}, tools=[WEATHER]),
    item("tl-4", "tool", "tl-stop", {"call": True, "name": "get_weather"}, {"kind": "call"}, tools=[WEATHER]),
    item("tl-5", "tool", "nf-ok", {"call": False}, {"kind": "nofit"}, tools=[WEATHER, TIME]),
    item("tl-6", "tool", "nf-call", {"call": False}, {"kind": "nofit"}, tools=[WEATHER, TIME]),
    item("ch-1", "chat", "chat", {}, {}, temperature=0.7),
]


class FakeOpenAI(http.server.ThreadingHTTPServer):
    def __init__(self):
        self.bodies, self.headers_seen = [], []
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self):
        self.shutdown()
        self.server_close()


class FakeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, status, body):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self.send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        self.server.headers_seen.append(dict(self.headers))
        case = body["messages"][-1]["content"].split(":", 1)[1]
        if case == "slow":
            time.sleep(3)
            case = "chat"
        self.send(*CANNED[case])


@pytest.fixture
def fake():
    s = FakeOpenAI()
    yield s
    s.stop()


def write_set(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def check_fake_scores(s):
    pk = s["summary"]["passkey"]
    assert pk["total"] == {"n": 4, "correct": 2, "errors": 1, "accuracy": 0.5}
    grid = {(c["context_tokens"], c["depth"]): (c["n"], c["correct"], c["errors"]) for c in pk["grid"]}
    assert grid == {(1024, 0.25): (1, 1, 0), (1024, 0.75): (1, 0, 0), (2048, 0.25): (1, 1, 0), (2048, 0.75): (1, 0, 1)}
    assert [(b["context_tokens"], b["correct"], b["n"]) for b in pk["by_length"]] == [(1024, 1, 2), (2048, 1, 2)]
    ar = s["summary"]["arith"]
    assert ar["total"] == {"n": 3, "correct": 1, "errors": 1, "accuracy": pytest.approx(1 / 3)}
    assert [(b["effort"], b["n"], b["correct"]) for b in ar["by_effort"]] == [("low", 1, 1), ("high", 2, 0)]
    t = s["summary"]["tool"]
    # tool_calls responses: tl-1, tl-2, tl-3, tl-6; schema-valid: tl-1, tl-6.
    assert (t["n"], t["tool_calls"], t["schema_valid"], t["expected_calls"], t["errors"]) == (6, 4, 2, 4, 0)
    assert t["schema_accuracy"] == 0.5
    # trigger right: tl-1, tl-2, tl-3 (called the expected tool), tl-5 (no call); wrong: tl-4, tl-6.
    assert t["trigger_correct"] == 4 and t["trigger_accuracy"] == pytest.approx(4 / 6)
    assert t["schema_failures"] == {"bad_json": 1, "schema": 1}
    assert t["trigger_by_kind"]["call"]["correct"] == 3 and t["trigger_by_kind"]["nofit"]["correct"] == 1
    assert s["summary"]["chat"] == {"n": 1, "answered": 1, "errors": 0}
    assert s["summary"]["items"] == 14 and s["summary"]["errors"] == 2
    byid = {i["id"]: i for i in s["items"]}
    assert byid["pk-1024-0.75"]["verdict"]["extracted"] == "11111"
    assert byid["pk-2048-0.25"]["verdict"]["extracted"] == "7"      # from content, not reasoning
    assert byid["ar-2"]["verdict"]["extracted"] == "-6"
    assert byid["pk-2048-0.75"]["error"].startswith("HTTP 500")
    assert "bad JSON" in byid["ar-3"]["error"]
    assert "is not of type" in byid["tl-2"]["verdict"]["schema_problem"]


def test_fake_endpoint_exact_scores_and_rescoring(kestrel_bin, fake, tmp_path):
    sets = [write_set(tmp_path / "a.jsonl", SET[:7]), write_set(tmp_path / "b.jsonl", SET[7:])]
    out = tmp_path / "r.json"
    p = run_kestrel(kestrel_bin, "eval", "--set", sets[0], "--set", sets[1], "--base-url", fake.url,
                    "--api-key", "sekrit", "--concurrency", 3, "--seed", 11, "--out", out, "--save-responses",
                    "--no-progress", timeout=60)
    assert p.returncode == 0, p.stderr
    s = json.loads(out.read_text())
    check_fake_scores(s)
    assert s["run"]["model"] == "fake-model" and "model: fake-model (from /v1/models)" in p.stdout
    # What was sent: every item once, to /v1/chat/completions, non-streamed, greedy unless the set says otherwise.
    assert len(fake.bodies) == 14
    for path, b in fake.bodies:
        assert path == "/v1/chat/completions"
        assert b["model"] == "fake-model" and b["stream"] is False and b["seed"] == 11 and b["max_tokens"] == 16
        assert b["temperature"] == (0.7 if b["messages"][0]["content"] == "case:chat" else 0)
    assert all(h.get("Authorization") == "Bearer sekrit" for h in fake.headers_seen)
    sent = {b["messages"][0]["content"]: b for _, b in fake.bodies}
    assert sent["case:ar-a"]["reasoning_effort"] == "low" and len(sent["case:tl-ok"]["tools"]) == 2
    # The tables.
    assert "Passkey retrieval" in p.stdout and "Arithmetic" in p.stdout and "Tool calls" in p.stdout
    assert re.search(r"^\s+1024\s+100\.0\s+0\.0\s+50\.0\s+1/2\s+0$", p.stdout, re.M), p.stdout
    assert re.search(r"^\s+2048\s+100\.0\s+0\.0\s+50\.0\s+1/2\s+1$", p.stdout, re.M), p.stdout
    assert re.search(r"schema accuracy \(%\)\s+50\.0", p.stdout) and re.search(r"trigger accuracy \(%\)\s+66\.7", p.stdout)
    assert "Items: 14, errors: 2" in p.stdout
    # Offline: the saved responses give the same scores without any endpoint.
    out2 = tmp_path / "r2.json"
    p = run_kestrel(kestrel_bin, "eval", "--set", sets[0], "--set", sets[1], "--score-responses", out, "--out", out2)
    assert p.returncode == 0, p.stderr
    s2 = json.loads(out2.read_text())
    check_fake_scores(s2)
    assert s2["summary"] == s["summary"] and s2["run"]["mode"] == "score-responses"
    # A partial responses file (a --limit run): the rest is left out, not failed.
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"items": [i for i in s["items"] if i["id"] in ("tl-1", "tl-6")]}))
    p = run_kestrel(kestrel_bin, "eval", "--set", sets[1], "--score-responses", partial, "--out", out2)
    assert p.returncode == 0, p.stderr
    assert "5 of 7 items have no saved response" in p.stdout
    assert json.loads(out2.read_text())["summary"]["tool"]["schema_valid"] == 2


def test_fake_endpoint_limit_and_v1_base_url(kestrel_bin, fake, tmp_path):
    sets = [write_set(tmp_path / "a.jsonl", SET[:7]), write_set(tmp_path / "b.jsonl", SET[7:])]
    out = tmp_path / "r.json"
    p = run_kestrel(kestrel_bin, "eval", "--set", sets[0], "--set", sets[1], "--base-url", fake.url + "/v1",
                    "--model", "m", "--limit", 2, "--out", out, "--no-progress", timeout=60)
    assert p.returncode == 0, p.stderr
    s = json.loads(out.read_text())
    assert [i["id"] for i in s["items"]] == ["pk-1024-0.25", "pk-1024-0.75", "tl-1", "tl-2"]
    assert all(path == "/v1/chat/completions" and b["model"] == "m" and "seed" not in b for path, b in fake.bodies)
    assert "response" not in s["items"][0]  # only with --save-responses


def test_timeout_is_that_items_error(kestrel_bin, fake, tmp_path):
    items = [SET[0], item("ch-slow", "chat", "slow", {}, {})]
    out = tmp_path / "r.json"
    p = run_kestrel(kestrel_bin, "eval", "--set", write_set(tmp_path / "a.jsonl", items), "--base-url", fake.url,
                    "--model", "m", "--timeout", 1, "--out", out, "--no-progress", timeout=60)
    assert p.returncode == 0, p.stderr
    s = json.loads(out.read_text())
    assert s["summary"]["errors"] == 1 and s["summary"]["passkey"]["total"]["correct"] == 1
    assert s["summary"]["chat"] == {"n": 1, "answered": 0, "errors": 1}
    assert s["items"][1]["error"] == "no data from the server for 1 s"


def test_unreachable_endpoint_counts_every_item_as_error(kestrel_bin, tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "r.json"
    p = run_kestrel(kestrel_bin, "eval", "--set", write_set(tmp_path / "a.jsonl", SET[:3]), "--base-url",
                    f"http://127.0.0.1:{port}", "--model", "m", "--out", out, "--no-progress", timeout=60)
    assert p.returncode == 1
    assert "error: all 3 items failed" in p.stderr
    s = json.loads(out.read_text())
    assert s["summary"]["errors"] == 3 and s["summary"]["passkey"]["total"]["correct"] == 0


def test_bad_sets_and_flags_are_clear_errors(kestrel_bin, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SET[0]) + "\n" + '{"id": "x", "task": "passkey"}\n')
    p = run_kestrel(kestrel_bin, "eval", "--set", bad, "--base-url", "http://127.0.0.1:9", "--model", "m")
    assert p.returncode == 1 and f"{bad}:2" in p.stderr and "request" in p.stderr
    dup = write_set(tmp_path / "dup.jsonl", [SET[0], SET[0]])
    p = run_kestrel(kestrel_bin, "eval", "--set", dup, "--base-url", "http://127.0.0.1:9", "--model", "m")
    assert p.returncode == 1 and "appears twice" in p.stderr
    ok = write_set(tmp_path / "ok.jsonl", SET[:1])
    p = run_kestrel(kestrel_bin, "eval", "--set", ok, "--score-responses", tmp_path / "none.json")
    assert p.returncode == 1 and "cannot read --score-responses" in p.stderr
    p = run_kestrel(kestrel_bin, "eval", "--set", ok, "--score-responses", ok, "--model", "m")
    assert p.returncode == 1 and "--model has no effect" in p.stderr
    p = run_kestrel(kestrel_bin, "eval", "--set", ok, "--save-responses")
    assert p.returncode == 1 and "--save-responses needs --out" in p.stderr


def test_against_kestrel_serve_on_nano(kestrel_bin, nano_dir, tmp_path):
    """Random weights: the answers are noise, so this checks the pipeline, not accuracy."""
    items = [dict(i, request=dict(i["request"], messages=[{"role": "user", "content": "What is the passkey? 1234"}],
                                  max_tokens=8))
             for i in SET if i["task"] != "chat"]
    # One request the server must reject (max_tokens -1; 0 is valid, the prompt only): an HTTP 400
    # counted as that item's error.
    items.append(item("ch-bad", "chat", "x", {}, {}, max_tokens=-1))
    s_path = write_set(tmp_path / "s.jsonl", items)
    server = Server(kestrel_bin, nano_dir, "--served-model-name", "nano", "--max-model-len", "2048")
    try:
        out = tmp_path / "r.json"
        p = run_kestrel(kestrel_bin, "eval", "--set", s_path, "--base-url", server.url, "--concurrency", 4,
                        "--out", out, "--save-responses", "--no-progress", timeout=300)
    finally:
        assert server.stop() == 0
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(out.read_text())
    sm = s["summary"]
    assert sm["items"] == len(items) and sm["errors"] == 1
    assert sm["passkey"]["total"]["n"] == 4 and sm["passkey"]["total"]["errors"] == 0
    assert sm["arith"]["total"]["n"] == 3 and sm["tool"]["n"] == 6 and sm["chat"] == {"n": 1, "answered": 0, "errors": 1}
    assert 0 <= sm["tool"]["schema_valid"] <= sm["tool"]["tool_calls"] <= 6
    assert len(s["items"]) == len(items)
    bad = next(i for i in s["items"] if i["id"] == "ch-bad")
    assert bad["error"].startswith("HTTP 400")
    for i in s["items"]:
        if i["id"] != "ch-bad":
            r = i["response"]
            assert r["finish_reason"] in ("stop", "length", "tool_calls")
            assert isinstance(r["content"], str) and isinstance(r["tool_calls"], list)
    assert "Passkey retrieval" in p.stdout and "Items: 14, errors: 1" in p.stdout
    assert sm["passkey"]["grid"][0]["context_tokens"] == 1024

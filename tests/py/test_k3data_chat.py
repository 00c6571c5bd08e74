"""train/k3data/chat.py against the engine: the Python K3 chat encoder must give the same ids as
`kestrel tokenize --chat` on 200 generated requests (tools with every JSON type, tool results
in and out of call order, multi-turn, reasoning_effort, names, assistant history with reasoning and calls,
special-looking text), and parse_output must invert the encoding of an assistant turn."""
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat  # noqa: E402

VOCAB = os.path.join(ROOT, "tests", "data", "tok_golden")
BIN = os.environ.get("KESTREL_BIN", os.path.join(ROOT, "build", "src", "cli", "kestrel"))

WORDS = ["alpha", "Beta", "gamma", "the", "quick", "brown", "fox", " ", "\n", "\t", "12345", "3.14", "über",
         "日本語", "😀", "<|open|>", "<|sep|>", "&amp;", '"quoted"', "tab\there", "  spaced  ", "x=1",
         "{\"a\": 1}", "\\", "\u00a0", "mixed Case", "end."]


def text(r, n_max=8):
    return "".join(r.choice(WORDS) for _ in range(r.randint(0, n_max)))


def json_value(r, depth=0):
    kinds = ["string", "int", "float", "bool", "null"] + (["object", "array"] if depth < 2 else [])
    k = r.choice(kinds)
    if k == "string":
        return text(r, 4)
    if k == "int":
        return r.randint(-10**6, 10**6)
    if k == "float":
        return r.choice([0.5, -2.25, 1e-7, 3.0, 123456.789, 1e20, r.uniform(-1e3, 1e3)])
    if k == "bool":
        return r.random() < 0.5
    if k == "null":
        return None
    if k == "object":
        return {text(r, 2) or "k": json_value(r, depth + 1) for _ in range(r.randint(0, 3))}
    return [json_value(r, depth + 1) for _ in range(r.randint(0, 3))]


def schema(r):
    props = {}
    for i in range(r.randint(0, 4)):
        t = r.choice(["string", "number", "integer", "boolean", "null", "object", "array"])
        p = {"type": t, "description": text(r, 3)}
        if t == "string" and r.random() < 0.3:
            p["enum"] = ["a", "b", "ü"]
        if t == "array":
            p["items"] = {"type": "number"}
        if t == "object":
            p["properties"] = {"z": {"type": "integer", "minimum": 0.5}}
        props[f"p{i}_{t}"] = p
    return {"type": "object", "properties": props, "required": sorted(props)[:1]}


def tools(r):
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": text(r, 5),
                                              "parameters": schema(r)}} for i in range(r.randint(1, 3))]


def assistant(r, tl):
    m = {"role": "assistant", "content": text(r) if r.random() < 0.8 else None}
    if r.random() < 0.6:
        m["reasoning_content"] = r.choice([text(r), "", "   \n"])
    if r.random() < 0.2:
        m["name"] = "bot"
    if tl and r.random() < 0.5:
        calls = []
        for i in range(r.randint(1, 3)):
            args = {text(r, 2) or "k": json_value(r) for _ in range(r.randint(0, 3))}
            form = r.random()
            if form < 0.6:
                a = json.dumps(args, ensure_ascii=r.random() < 0.5)
            elif form < 0.8:
                a = args
            elif form < 0.9:
                a = "{not json"
            else:
                a = r.choice(["", "  ", None])
            calls.append({"id": f"call_{r.randint(0, 99)}_{i}", "type": "function",
                          "function": {"name": r.choice(tl)["function"]["name"], "arguments": a}})
        m["tool_calls"] = calls
    return m


def request(r):
    tl = tools(r) if r.random() < 0.5 else None
    msgs = []
    if r.random() < 0.3:
        msgs.append({"role": r.choice(["system", "developer"]), "content": text(r)})
    for _ in range(r.randint(1, 3)):
        u = {"role": "user", "content": text(r) if r.random() < 0.8 else [{"type": "text", "text": text(r)},
                                                                            {"type": "text", "text": text(r)}]}
        if r.random() < 0.2:
            u["name"] = r.choice(["alice", 'b"o&b'])
        msgs.append(u)
        a = assistant(r, tl)
        msgs.append(a)
        calls = a.get("tool_calls") or []
        if calls:
            res = [{"role": "tool", "tool_call_id": c["id"], "content": text(r)} for c in calls]
            if r.random() < 0.5:
                r.shuffle(res)
            if r.random() < 0.15:
                res[0]["tool_call_id"] = "unknown"
                res[0]["name"] = "named_tool"
            msgs.extend(res)
    if r.random() < 0.5:
        msgs.append({"role": "user", "content": text(r)})
    req = {"messages": msgs}
    if tl:
        req["tools"] = tl
    if r.random() < 0.5:
        req["reasoning_effort"] = r.choice(["low", "medium", "high", "max", "none"])
    if r.random() < 0.2:
        req["thinking"] = r.random() < 0.5
    if r.random() < 0.2:
        req["add_generation_prompt"] = False
    if tl and r.random() < 0.2:
        req["tool_choice"] = r.choice(["auto", "required", "none", {"type": "function",
                                                                     "function": {"name": tl[0]["function"]["name"]}}])
    if r.random() < 0.1:
        req["response_format"] = r.choice([{"type": "json_object"}, {"type": "text"},
                                           {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(r)}}])
    return req


@pytest.fixture(scope="module")
def tok():
    return chat.Tokenizer(VOCAB)


def kestrel_chat(req):
    r = subprocess.run([BIN, "tokenize", "--model", VOCAB, "--chat"], input=json.dumps(req).encode(),
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    prompt, ids = r.stdout.decode().rstrip("\n").rsplit("\n", 1)
    return prompt, [int(x) for x in ids.split()]


def kestrel_chat_batch(reqs):
    """`kestrel tokenize --chat --jsonl`: every request in one process (one line in, one line out each)."""
    inp = "".join(json.dumps(q) + "\n" for q in reqs).encode()
    r = subprocess.run([BIN, "tokenize", "--model", VOCAB, "--chat", "--jsonl"], input=inp, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    out = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert len(out) == len(reqs)
    return [(o["prompt"], o["ids"]) for o in out]


def test_encoder_matches_engine(tok):
    r = random.Random(20261129)
    reqs = [request(r) for _ in range(200)]
    got = kestrel_chat_batch(reqs)
    for n, (req, (prompt, ids)) in enumerate(zip(reqs, got)):
        assert chat.render_text(req) == prompt, (n, req)
        assert chat.encode_request(tok, req) == ids, (n, req)
    # The one-request mode renders the same (three of them, each its own process).
    for n in (0, 77, 199):
        assert kestrel_chat(reqs[n]) == got[n], n


def test_chat_jsonl_reports_the_bad_line():
    r = subprocess.run([BIN, "tokenize", "--model", VOCAB, "--chat", "--jsonl"],
                       input=b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": \n', capture_output=True,
                       timeout=60)
    assert r.returncode != 0
    assert "jsonl line 2" in r.stderr.decode()


def test_encode_chat_interface(tok):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    req = {"messages": msgs, "reasoning_effort": "high"}
    assert chat.encode_chat(tok, msgs, reasoning_effort="high") == kestrel_chat(req)[1]
    t = tools(random.Random(1))
    assert chat.encode_chat(tok, msgs, tools=t, thinking=False) == kestrel_chat(
        {"messages": msgs, "tools": t, "thinking": False})[1]


def test_training_mask_covers_assistant_turns_only(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    ids, mask = chat.encode_training(tok, msgs)
    assert len(ids) == len(mask)
    # Each unmasked-then-masked boundary is a generation prompt; the masked runs are the completions.
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert runs == [chat.encode_completion(tok, msgs[1]), chat.encode_completion(tok, msgs[3])]
    assert runs[0][-1] == tok.special("<|end_of_msg|>")
    prompt = chat.encode_chat(tok, msgs[:1])
    assert ids[:len(prompt)] == prompt  # prompt of turn 1 = prefix of the conversation


def test_parse_output_round_trip(tok):
    r = random.Random(7)
    for _ in range(300):
        tl = tools(r)
        m = assistant(r, tl)
        thinking = r.random() < 0.8
        ids = chat.encode_completion(tok, m, thinking=thinking)
        out = chat.parse_output(tok, ids, thinking=thinking, known_tools=[t["function"]["name"] for t in tl])
        assert out["content"] == (m["content"] or "")
        if thinking:
            rc = m.get("reasoning_content") or ""
            assert out["reasoning_content"] == (rc if rc.strip() else "")
        calls = m.get("tool_calls") or []
        assert out["finish_reason"] == ("tool_calls" if calls else "stop")
        assert [c["name"] for c in out["tool_calls"]] == [c["function"]["name"] for c in calls]
        for got, c in zip(out["tool_calls"], calls):
            a = c["function"]["arguments"]
            if isinstance(a, str) and a.strip() and a.startswith("{not"):
                assert got["arguments"] == a
            else:
                want = a if isinstance(a, dict) else (json.loads(a) if a and a.strip() else {})
                assert json.loads(got["arguments"]) == want
        raw_block = any(isinstance(c["function"]["arguments"], str) and c["function"]["arguments"].startswith("{not")
                        for c in calls)
        assert (out["errors"] != []) == raw_block  # only an unparseable json block is reported


def test_parse_output_truncated_and_malformed(tok):
    ids = chat.encode_completion(tok, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": '{"x": "abc"}'}}]})
    cut = ids[:len(ids) - 12]
    out = chat.parse_output(tok, cut)
    assert out["finish_reason"] == "length"
    assert out["tool_calls"][0].get("error") == "truncated"
    bad = tok.encode_special('<|open|>bogus<|sep|>text') + [tok.special("<|end_of_msg|>")]
    out = chat.parse_output(tok, bad, thinking=False)
    assert out["content"] == "<|open|>bogus<|sep|>text" and out["finish_reason"] == "stop"

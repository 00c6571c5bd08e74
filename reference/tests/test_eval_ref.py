"""reference/eval_ref.py on the random-weight nano checkpoint: chunked prefill answers exactly as one prefill
does, the output has the shape `kestrel eval --score-responses` reads (and it does read it: the built binary
is required), and a request chat.py refuses becomes that item's error instead of ending the run.

Needs torch (like every reference test), train/k3data/chat.py of this tree and the built `kestrel`."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reference"))

import eval_ref  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ITEMS = [
    {"id": "pk-1", "task": "passkey", "expect": {"answer": "4821"}, "meta": {"context_tokens": 64, "depth": 0.5},
     "request": {"messages": [{"role": "user", "content": "Filler. The passkey is 4821. Filler. The passkey?"}],
                 "max_tokens": 5}},
    {"id": "tl-1", "task": "tool", "expect": {"call": True, "name": "get_weather"}, "meta": {"kind": "call"},
     "request": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, "max_tokens": 4,
                 "reasoning_effort": "low"}},
    {"id": "ar-1", "task": "arith", "expect": {"answer": "4"}, "meta": {"effort": "none"},
     "request": {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 3, "reasoning_effort": "none"}},
    # chat.py refuses a message without a role: this item's error, not the run's.
    {"id": "bad-1", "task": "chat", "expect": {}, "meta": {},
     "request": {"messages": [{"content": "no role"}], "max_tokens": 2}},
]


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    out = tmp_path_factory.mktemp("nano") / "ckpt"
    subprocess.run([sys.executable, str(ROOT / "reference" / "make_checkpoint.py"), "--config", "nano", "--out",
                    str(out), "--seed", "1"], check=True, capture_output=True)
    return str(out)


def test_chunked_prefill_answers_as_one_prefill(nano):
    chat = eval_ref.import_chat()
    one = eval_ref.Runner(nano, chat, "cpu", chunk=4096)
    chunked = eval_ref.Runner(nano, chat, "cpu", chunk=5)
    for it in ITEMS[:3]:
        a, plen, glen = one.answer(it["request"], 8)
        b, plen2, glen2 = chunked.answer(it["request"], 8)
        assert plen > 5 and plen == plen2 and glen == glen2
        assert a == b
        assert glen <= it["request"]["max_tokens"]
        assert a["finish_reason"] in ("stop", "length", "tool_calls")


def test_output_is_read_by_kestrel_eval(nano, tmp_path):
    s = tmp_path / "s.jsonl"
    s.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    out = tmp_path / "ref.json"
    eval_ref.main(["--model", nano, "--set", str(s), "--out", str(out), "--device", "cpu", "--chunk", "16"])
    doc = json.loads(out.read_text())
    assert [i["id"] for i in doc["items"]] == ["pk-1", "tl-1", "ar-1", "bad-1"]
    assert doc["dtype"] == "float32" and doc["decoding"] == "greedy"
    for i in doc["items"][:3]:
        r = i["response"]
        assert set(r) == {"finish_reason", "content", "reasoning_content", "tool_calls"}
    assert "error" in doc["items"][3] and "response" not in doc["items"][3]
    kestrel = pathlib.Path(os.environ.get("KESTREL_BIN", ROOT / "build" / "src" / "cli" / "kestrel"))
    assert kestrel.exists(), f"{kestrel} not built (scripts/build.sh): the offline scoring half needs it"
    scored = tmp_path / "scored.json"
    p = subprocess.run([str(kestrel), "eval", "--set", str(s), "--score-responses", str(out), "--out", str(scored)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    sm = json.loads(scored.read_text())["summary"]
    assert sm["items"] == 4 and sm["errors"] == 1
    assert sm["passkey"]["total"]["n"] == 1 and sm["tool"]["n"] == 1 and sm["arith"]["total"]["n"] == 1

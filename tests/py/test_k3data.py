"""train/k3data without torch (runs in CI): generators are deterministic and correct, training rows carry the
loss on assistant turns only, the committed evaluation sets are exactly what make_eval.py writes, and the
scoring rules behave as the eval-set format says."""
import json
import os
import random
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat, gen, make_eval, samples, score  # noqa: E402

VOCAB = os.path.join(ROOT, "tests", "data", "tok_golden")
EVAL_DIR = os.path.join(ROOT, "models", "k3-tiny", "eval")


@pytest.fixture(scope="module")
def tok():
    return chat.Tokenizer(VOCAB)


def test_generators_are_deterministic():
    for name, fn in gen.GENERATORS.items():
        for s in (0, 1, 999_999):
            assert json.dumps(fn(s)) == json.dumps(fn(s)), name
    assert gen.arith(1) != gen.arith(2)


def test_arith_answers_and_effort_lengths():
    lengths = {"low": [], "high": [], "max": []}
    for s in range(300):
        for effort in lengths:
            c = gen.arith(s, effort=effort)
            ans = int(c["expect"]["answer"])
            m = c["messages"][-1]
            assert m["content"] == str(ans)
            # the story's operations, replayed, give the answer
            story = c["messages"][0]["content"]
            total = int(re.search(r"has (\d+)", story).group(1))
            for op in re.findall(r"(buys|finds|gets|is given|wins|gives away|loses|sells|uses|multiplied by) (\d+)",
                                 story):
                n = int(op[1])
                total = total * n if op[0] == "multiplied by" else (total - n if op[0] in (
                    "gives away", "loses", "sells", "uses") else total + n)
            assert total == ans, story
            assert str(ans) in m["reasoning_content"]
            lengths[effort].append(len(m["reasoning_content"]))
    mean = {k: sum(v) / len(v) for k, v in lengths.items()}
    assert mean["low"] * 2 < mean["high"] and mean["high"] * 2 < mean["max"], mean


def test_tool_calls_are_schema_valid_and_cover_every_type():
    types, nofit = set(), 0
    for s in range(2000):
        c = gen.tool(s)
        decl = {t["function"]["name"]: t["function"]["parameters"] for t in c["tools"]}
        a = c["messages"][1]
        if c["expect"]["call"]:
            call = a["tool_calls"][0]["function"]
            args = json.loads(call["arguments"])
            assert call["name"] in decl
            assert score.validate(args, decl[call["name"]]), (call, decl[call["name"]])
            for v in args.values():
                types.add(gen._types(v))
            assert c["messages"][2]["role"] == "tool" and c["messages"][3]["role"] == "assistant"
        else:
            nofit += 1
            assert "tool_calls" not in a and a["content"]
    assert types == {"string", "number", "integer", "boolean", "null", "object", "array"}
    assert 300 < nofit < 700


def test_validator_rejects_what_it_should():
    sch = gen.TOOLS["set_thermostat"]["function"]["parameters"]
    assert score.validate({"temperature": 20, "mode": "heat", "zone": None}, sch)
    assert not score.validate({"temperature": "20", "mode": "heat", "zone": None}, sch)
    assert not score.validate({"temperature": 20, "mode": "warm", "zone": None}, sch)
    assert not score.validate({"temperature": 20, "mode": "heat"}, sch)
    ev = gen.TOOLS["create_event"]["function"]["parameters"]
    assert not score.validate({"title": "x", "attendees": ["a", 3], "duration_minutes": 5}, ev)
    assert not score.validate({"title": "x", "attendees": [], "duration_minutes": 5, "location": {"room": 1}}, ev)
    assert not score.validate({"hour": 24, "minute": 0}, gen.TOOLS["set_alarm"]["function"]["parameters"])


def test_passkey_depth_and_length(tok):
    for ctx in (1024, 4096):
        for d in make_eval.DEPTHS:
            c = gen.passkey(77, context_tokens=ctx, depth=d, tok=tok)
            text = c["messages"][0]["content"]
            key = c["expect"]["answer"]
            assert text.count(f"The pass key is {key}.") == 1
            body = text[len(gen.PASSKEY_INTRO):-len(gen.PASSKEY_Q)]
            pos = body.index(f"The pass key is {key}.") / max(1, len(body))
            assert abs(pos - d) < 0.05
            n = len(chat.encode_chat(tok, c["messages"][:1]))
            assert 0.95 * ctx <= n <= 1.03 * ctx, (ctx, n)


def test_training_rows_weight_assistant_turns(tok):
    eos = tok.special("[EOS]")
    g = samples.rows(tok, 1024, 0)
    for _ in range(5):
        ids, w, _ = next(g)
        assert len(ids) == len(w) == 1024
        assert set(w.tolist()) <= {0.0, float(np.float32(0.1)), 1.0}
        # every full-weight run ends with <|end_of_msg|> and starts right after an assistant generation prompt
        gp = chat.generation_prompt_ids(tok)
        i = 0
        while i < len(w):
            if w[i] == 1.0 and (i == 0 or w[i - 1] != 1.0):
                assert list(ids[i - len(gp):i]) == gp
                j = i
                while j < len(w) and w[j] == 1.0:
                    j += 1
                assert ids[j - 1] == tok.special("<|end_of_msg|>")
                i = j
            else:
                i += 1
        assert all(w[k] == 0.0 for k in range(len(ids)) if ids[k] == eos)


def test_committed_eval_sets_are_reproducible(tmp_path, tok):
    """models/k3-tiny/eval holds exactly what `make_eval.py --max-context 4096 --passkey-reps 1` writes."""
    assert os.path.isdir(EVAL_DIR), f"{EVAL_DIR}: the committed eval sets are missing"
    make_eval.main(["--out", str(tmp_path), "--tokenizer", VOCAB, "--max-context", "4096", "--passkey-reps", "1"])
    for fn in sorted(os.listdir(EVAL_DIR)):
        if fn.endswith(".jsonl"):
            with open(os.path.join(EVAL_DIR, fn), "rb") as a, open(tmp_path / fn, "rb") as b:
                assert a.read() == b.read(), fn
    with open(os.path.join(EVAL_DIR, "tool.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) >= 200 and all(r["request"]["temperature"] == 0 for r in recs)
    assert all(int(r["id"].rsplit("-s", 1)[1]) >= 1_000_000 for r in recs)


def test_scoring_rules():
    assert score.last_int_correct("The pass key is 48213.", "48213")
    assert not score.last_int_correct("48213 or maybe 11111", "48213")
    assert score.last_int_correct("-12", "-12") and not score.last_int_correct("", "1")
    tools = [gen.TOOLS["get_weather"]]
    ok = {"finish_reason": "tool_calls", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]}
    assert score.tool_scores(ok, tools, {"call": True, "name": "get_weather"}) == \
        {"called": True, "schema_ok": True, "trigger_ok": True}
    bad = {"finish_reason": "tool_calls", "tool_calls": [{"name": "get_weather", "arguments": '{"unit": "kelvin"}'}]}
    assert score.tool_scores(bad, tools, {"call": True, "name": "get_weather"})["schema_ok"] is False
    unk = {"finish_reason": "tool_calls", "tool_calls": [{"name": "nope", "arguments": "{}"}]}
    assert score.tool_scores(unk, tools, {"call": True, "name": "get_weather"})["schema_ok"] is False
    plain = {"finish_reason": "stop", "tool_calls": []}
    assert score.tool_scores(plain, tools, {"call": False}) == {"called": False, "schema_ok": None, "trigger_ok": True}
    assert score.tool_scores(plain, tools, {"call": True, "name": "get_weather"})["trigger_ok"] is False

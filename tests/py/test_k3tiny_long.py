"""models/k3-tiny-long, k3-tiny after its long-context stage (models/k3-tiny-long/README.md; issue #15 point 6:
on the H200 it answers pass keys at 1,048,576 tokens): the CPU engine loads it and answers 32K-token pass keys
with the key at the very start (depth 0, the case the earlier exports lost first) and in the middle — prompts
from the evaluation's own generator (seeds ≥ 1,000,000, never trained on), answers compared with the key the
generator hid, not with anything the engine printed before. About a minute on the 2-core CI machine."""
import os
import sys

import httpx

from serve_util import Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat, make_eval  # noqa: E402

MODEL = os.path.join(ROOT, "models", "k3-tiny-long")


def test_k3_tiny_long_answers_32k_pass_keys_at_depth_0_and_half(kestrel_bin):
    tok = chat.Tokenizer(MODEL)
    items = make_eval.passkey_set(tok, max_context=32768, reps=1, min_context=32768, depths=(0.0, 0.5))
    assert len(items) == 2
    s = Server(kestrel_bin, MODEL, "--device", "cpu", "--max-num-seqs", "1", "--max-model-len", "40960",
               "--served-model-name", "k3-tiny-long")
    try:
        for it in items:
            r = httpx.post(s.url + "/v1/chat/completions", json={"model": "k3-tiny-long", **it["request"]},
                           timeout=600)
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["message"]["content"]
            assert content.strip() == it["expect"]["answer"], (it["id"], content)
    finally:
        assert s.stop() == 0

"""k3data.spec_eval (DSpark acceptance per task and the k3-tiny-dspark model card) without the engine or torch:
parsing `kestrel generate` output, the per-task summary and greedy comparison, the even subset, and the card
filled from a measurement (every placeholder substituted, numbers where they belong).  The engine's
`speculative:` line itself is checked end to end in test_spec_serve.py's generate test."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import spec_eval  # noqa: E402

MULTI = """[0] tokens: 5,6,7
[0] text: abc
[0] finish: stop, 10 prompt tokens, first token 0.1 s, done 0.2 s
[1] tokens: 8
[1] finish: stop, 12 prompt tokens, first token 0.1 s, done 0.2 s
requests: 2 in 0.3 s; prompt 22 tokens, generated 4 tokens; 13.3 generated tok/s, 86.7 total tok/s
engine: 5 steps, 0 preemptions, prefix cache 0 hits / 2 queries skipping 0 tokens, 30 positions computed
speculative: 4 drafts, 28 draft tokens, 6 accepted; acceptance length 2.500
"""


def test_parse_generate_multi_single_and_plain():
    r = spec_eval.parse_generate(MULTI, 2)
    assert r["tokens"] == [[5, 6, 7], [8]]
    assert (r["drafts"], r["draft_tokens"], r["accepted"]) == (4, 28, 6)
    r = spec_eval.parse_generate("tokens: 1,2\nfinish: length\n", 1)
    assert r["tokens"] == [[1, 2]] and r["drafts"] == 0
    with pytest.raises(ValueError):
        spec_eval.parse_generate(MULTI, 3)          # a missing prompt is an error, not a shorter list


def test_pick_spreads_over_the_set():
    recs = list(range(150))
    assert spec_eval.pick(recs, 0) == recs and spec_eval.pick(recs, 200) == recs
    p = spec_eval.pick(recs, 6)
    assert p == [0, 25, 50, 75, 100, 125]


def test_task_result_and_overall():
    plain = {"tokens": [[1, 2, 3], [4, 5]], "seconds": 1.0}
    spec = {"tokens": [[1, 2, 3], [4, 6]], "drafts": 2, "draft_tokens": 14, "accepted": 3, "seconds": 0.5}
    t = spec_eval.task_result(plain, spec, ["a", "b"])
    assert t["acceptance_length"] == 2.5 and t["greedy_identical"] == 1 and t["greedy_differences"] == ["b"]
    u = dict(t, acceptance_length=4.5, drafts=2, accepted_tokens=7, greedy_differences=[])
    o = spec_eval.overall({"x": t, "y": u})
    assert o["mean_over_tasks"] == 3.5             # each task counts once
    assert o["pooled"] == 1 + 10 / 4 and o["greedy_differences"] == 1 and o["items"] == 4


def test_card_is_filled():
    cfg = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 64,
           "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
           "intermediate_size": 512, "markov_rank": 32, "num_speculative_tokens": 7, "mask_token_id": 12253,
           "rope_theta": 10000.0, "target_layer_ids": [1, 2, 4, 5, 7],
           "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048}}
    task = {"items": 3, "generated_tokens": 300, "drafts": 80, "draft_tokens": 560, "accepted_tokens": 240,
            "acceptance_length": 4.0, "greedy_identical": 3, "greedy_differences": [], "seconds_plain": 10.0,
            "seconds_spec": 6.0}
    spec = {"speculative_config": {"num_speculative_tokens": 7}, "limit": 3,
            "tasks": {"tool": task, "arith": dict(task, acceptance_length=2.5)},
            "overall": {"mean_over_tasks": 3.25, "pooled": 3.9, "greedy_differences": 0, "items": 6}}
    log = [{"step": s, "elapsed_s": s / 5, "loss": 3.0 / s, "agreement_by_position": [0.9] * 7} for s in (25, 50, 75)]
    train = {"args": {"anchors": 64, "reuse": 2, "lr": 0.003, "decay": 0.8, "labels": "target", "batch": 16,
                      "seq": 2048},
             "device": "NVIDIA H200", "train_seconds": 240.2, "steps": 1500, "rows": 12000, "tokens": 24576000,
             "draft_params": 2096896, "draft_bytes": 4193792, "log": log,
             "held_out": {"tool": {"blocks": 900, "acceptance_estimate": 5.1, "agreement_by_position": [0.95] * 7}}}
    with open(os.path.join(ROOT, "train", "k3data", "dspark_card.md")) as f:
        template = f.read()
    text = spec_eval.card_text(cfg, spec, train, template)
    assert "$" not in text.replace("$OUT", "")     # every placeholder filled ($$OUT is the shell's)
    assert "**3.25**" in text and "target ≥ 3: **met**" in text
    assert "| tool | 3 | 300 | 80 | 240 | **4.00** | 3 / 3 |" in text
    assert "| arith | 3 | 300 | 80 | 240 | **2.50** |" in text
    assert "NVIDIA H200" in text and "24,576,000" in text and "| tool | 900 | 5.10 |" in text
    spec["overall"]["greedy_differences"] = 1
    assert "target ≥ 3: **NOT met**" in spec_eval.card_text(cfg, spec, None, template)

#!/usr/bin/env python3
"""Generate a random-weight DSpark draft checkpoint (MODEL.md §5, Appendix A) for a generated target.

    python3 reference/make_draft.py --config {nano,mini} --out DIR [--seed N] [--override key=value ...]

Writes DIR/config.json (`model_type "k3_dspark"`, every field of §5 that the engine reads) and
DIR/model.safetensors with the tensors listed in reference/k3ref/dspark.py (kestrel's draft layout; the
embedding and lm_head are the target's and are not stored). Reproducible like make_checkpoint.py: every
tensor has its own PCG64 stream (seeded from the seed and "dspark:" + its name) and only IEEE basic
operations turn raw draws into values, so the same seed gives byte-identical files on every machine.

Presets: nano = Appendix A (1 layer, hidden 256, 4 heads, block 4, Markov rank 16, taps [1, 5]) for the nano
target; mini = 5 layers at the released dimensions (96 heads, q/kv LoRA 1536/512, FFN 14336, rank 512) with
taps inside the mini target's 8 layers. Both use DeepSeek-YaRN RoPE (nano with a short original context so
that the YaRN ramp is exercised by test positions).

Initialisation: linear weights N(0, 1/fan_in), o_proj and down_proj with make_checkpoint's OUT_GAIN, norm weights
1 + 0.02·N, markov_w1 N(0, 1) and markov_w2 N(0, 1/r) (the Markov correction is then O(1), like the base
logits of a random lm_head).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_checkpoint as mc  # noqa: E402

PRESETS = {
    "nano": dict(target="nano", hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                 q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 vocab_size=1024, target_layer_ids=[1, 5], markov_rank=16, num_speculative_tokens=4,
                 rope_theta=10000.0,
                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "mini": dict(target="mini", hidden_size=7168, intermediate_size=14336, num_hidden_layers=5, num_attention_heads=96,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 vocab_size=163840, target_layer_ids=[1, 2, 4, 5, 7], markov_rank=512, num_speculative_tokens=7,
                 rope_theta=50000.0,
                 rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def draft_config(preset, overrides=()):
    p = dict(PRESETS[preset])
    p.pop("target")
    cfg = {
        "architectures": ["DSparkForCausalLM"],
        "model_type": "k3_dspark",
        "torch_dtype": "bfloat16",
        "num_key_value_heads": p["num_attention_heads"],
        "mla_use_nope": False,
        "mla_use_output_gate": False,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 1048576,
        "num_target_layers": len(p["target_layer_ids"]),
        "target_hidden_size": p["hidden_size"],
        "fc_norm": True,
        "aux_hidden_stream": "attn_res",
        "mask_token_id": p["vocab_size"] - mc.NUM_SPECIALS + 253,
        "markov_head_type": "vanilla",
        "enable_confidence_head": False,
        "confidence_head_with_markov": False,
        "tie_word_embeddings": True,
    }
    cfg.update(p)
    for key, value in overrides:
        cfg[key] = value
    cfg["num_target_layers"] = len(cfg["target_layer_ids"])
    # The mask token follows an overridden vocabulary (as make_checkpoint's bos/eos/pad do), unless it is
    # overridden itself: a reduced target's vocab_size=8192 left it at 163837, outside the vocabulary.
    if "mask_token_id" not in dict(overrides):
        cfg["mask_token_id"] = cfg["vocab_size"] - mc.NUM_SPECIALS + 253
    return cfg


def inventory(cfg):
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hm, Q, C = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    N, R, Dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["markov_rank"]
    n_in = cfg["target_hidden_size"] * len(cfg["target_layer_ids"])
    t = [mc.lin("context_proj.weight", D, n_in), mc.norm("context_norm.weight", D)]
    for l in range(cfg["num_hidden_layers"]):
        P = "layers.%d." % l
        A = P + "self_attn."
        t += [mc.norm(P + "input_layernorm.weight", D), mc.norm(P + "post_attention_layernorm.weight", D),
              mc.lin(A + "q_a_proj.weight", Q, D), mc.norm(A + "q_a_layernorm.weight", Q),
              mc.lin(A + "q_b_proj.weight", Hm * (N + R), Q), mc.lin(A + "kv_a_proj_with_mqa.weight", C + R, D),
              mc.norm(A + "kv_a_layernorm.weight", C), mc.lin(A + "kv_b_proj.weight", Hm * (N + Dv), C),
              mc.lin(A + "o_proj.weight", D, Hm * Dv, mc.OUT_GAIN),
              mc.lin(P + "mlp.gate_proj.weight", F, D), mc.lin(P + "mlp.up_proj.weight", F, D),
              mc.lin(P + "mlp.down_proj.weight", D, F, mc.OUT_GAIN)]
    t += [mc.norm("norm.weight", D), mc.rand("markov_w1.weight", (V, r), 1.0),
          mc.rand("markov_w2.weight", (V, r), 1.0 / math.sqrt(r))]
    return t


def generate(preset, out, seed=0, overrides=()):
    os.makedirs(out, exist_ok=True)
    cfg = draft_config(preset, overrides)
    mc.dump_json(cfg, os.path.join(out, "config.json"))
    tensors = inventory(cfg)
    arrays = {}
    for t in tensors:
        _, std, mean = t.init
        arrays[t.name] = np.ascontiguousarray(
            mc.normal_values(mc.Stream(seed, "dspark:" + t.name), math.prod(t.shape), std, mean, t.dtype)
        ).reshape(t.shape)
    mc.write_shard(os.path.join(out, "model.safetensors"), tensors, arrays)
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate a random-weight DSpark draft checkpoint.")
    ap.add_argument("--config", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], type=mc.parse_override, metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    generate(args.config, args.out, args.seed, args.override)


if __name__ == "__main__":
    main()

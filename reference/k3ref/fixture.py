"""A tiny random checkpoint in the released layout (MODEL.md §1, §2, §4), for the reference's own tests.

This is NOT the project's checkpoint generator (`reference/make_checkpoint.py`, branch ckpt); it exists so the
reference can be tested without it.  Default dims = Appendix A "nano"; `overrides` change text_config fields.
Experts are written as MXFP4 (`weight_packed` + `weight_scale`) with the §0.9 rule.
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from . import mxfp4

NANO = {
    "model_type": "kimi_linear",
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 512,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "routed_expert_hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_shared_experts": 2,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "attn_res_block_size": 3,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 64,
    "bos_token_id": 1020,
    "eos_token_id": 1021,
    "pad_token_id": 1023,
    "linear_attn_config": {"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                           "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
}


def _lin(g, out, inp, gain=1.0):
    return (torch.randn(out, inp, generator=g, dtype=torch.float64) * gain / math.sqrt(inp)).to(torch.bfloat16)


def _vec(g, n, mean, std, dtype=torch.bfloat16):
    return (mean + std * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)


def make_tensors(tc: dict, seed: int, mix_std: float = 0.2, mlp_gain: float = 2.0, attn_gain: float = 2.0,
                 router_gain: float = 2.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    D, V, nL = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    lac = tc["linear_attn_config"]
    H, Dk, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    Hm, Q, C = tc["num_attention_heads"], tc["q_lora_rank"], tc["kv_lora_rank"]
    N, R, Dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    X, Lt, I = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    Is = I * tc["num_shared_experts"]
    Hi, Di = tc["index_n_heads"], tc["index_head_dim"]
    t = {}
    pre = "language_model."
    t[pre + "model.embed_tokens.weight"] = (torch.randn(V, D, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    t[pre + "lm_head.weight"] = _lin(g, V, D)
    t[pre + "model.norm.weight"] = _vec(g, D, 1.0, 0.1)
    t[pre + "model.output_attn_res_norm.weight"] = _vec(g, D, 1.0, 0.1)
    t[pre + "model.output_attn_res_proj.weight"] = _vec(g, D, 0.0, mix_std).view(1, D)
    for L in range(nL):
        P = f"{pre}model.layers.{L}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[P + n + ".weight"] = _vec(g, D, 1.0, 0.1)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            t[P + n + ".weight"] = _vec(g, D, 0.0, mix_std).view(1, D)
        A = P + "self_attn."
        if (L + 1) in lac["kda_layers"]:
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                t[A + n + ".weight"] = _lin(g, H * Dk, D)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[A + n + ".weight"] = (torch.randn(H * Dk, 1, W, generator=g, dtype=torch.float64) * 0.5
                                        ).to(torch.float32)
            t[A + "f_a_proj.weight"] = _lin(g, Dk, D)
            t[A + "f_b_proj.weight"] = _lin(g, H * Dk, Dk)
            t[A + "b_proj.weight"] = _lin(g, H, D)
            npad = math.ceil(H / 128) * 128
            a_log = torch.zeros(npad, dtype=torch.float32)
            a_log[:H] = torch.log(1.0 + 15.0 * torch.rand(H, generator=g, dtype=torch.float64)).float()
            t[A + "A_log"] = a_log
            t[A + "dt_bias"] = _vec(g, H * Dk, 0.0, 0.5, torch.float32)
            t[A + "o_norm.weight"] = _vec(g, Dk, 1.0, 0.1, torch.float32)
            t[A + "o_proj.weight"] = _lin(g, D, H * Dk)
        else:
            t[A + "q_a_proj.weight"] = _lin(g, Q, D)
            t[A + "q_a_layernorm.weight"] = _vec(g, Q, 1.0, 0.1)
            t[A + "q_b_proj.weight"] = _lin(g, Hm * (N + R), Q, gain=attn_gain)
            t[A + "kv_a_proj_with_mqa.weight"] = _lin(g, C + R, D)
            t[A + "kv_a_layernorm.weight"] = _vec(g, C, 1.0, 0.1)
            t[A + "kv_b_proj.weight"] = _lin(g, Hm * (N + Dv), C, gain=attn_gain)
            t[A + "g_proj.weight"] = _lin(g, Hm * Dv, D)
            t[A + "o_proj.weight"] = _lin(g, D, Hm * Dv)
            if tc.get("index_topk", 0) > 0:
                J = A + "indexer."
                t[J + "wq_b.weight"] = _lin(g, Hi * Di, Q, gain=attn_gain)
                t[J + "wk.weight"] = _lin(g, Di, D)
                t[J + "k_norm.weight"] = _vec(g, Di, 1.0, 0.1)
                t[J + "k_norm.bias"] = _vec(g, Di, 0.0, 0.1)
                t[J + "weights_proj.weight"] = _lin(g, Hi, D)
        if L < tc["first_k_dense_replace"]:
            M = P + "mlp."
            F = tc["intermediate_size"]
            t[M + "gate_proj.weight"] = _lin(g, F, D, mlp_gain)
            t[M + "up_proj.weight"] = _lin(g, F, D, mlp_gain)
            t[M + "down_proj.weight"] = _lin(g, D, F)
        else:
            M = P + "block_sparse_moe."
            t[M + "gate.weight"] = _lin(g, X, D, router_gain)
            t[M + "gate.e_score_correction_bias"] = _vec(g, X, 0.0, 0.05, torch.float32)
            t[M + "routed_expert_down_proj.weight"] = _lin(g, Lt, D)
            t[M + "routed_expert_norm.weight"] = _vec(g, Lt, 1.0, 0.1)
            t[M + "routed_expert_up_proj.weight"] = _lin(g, D, Lt)
            for e in range(X):
                for w, (o, i) in (("w1", (I, Lt)), ("w3", (I, Lt)), ("w2", (Lt, I))):
                    packed, scale = mxfp4.quantize(torch.randn(o, i, generator=g, dtype=torch.float64)
                                                   * mlp_gain / math.sqrt(i))
                    t[f"{M}experts.{e}.{w}.weight_packed"] = packed
                    t[f"{M}experts.{e}.{w}.weight_scale"] = scale
            t[M + "shared_experts.gate_proj.weight"] = _lin(g, Is, D, mlp_gain)
            t[M + "shared_experts.up_proj.weight"] = _lin(g, Is, D, mlp_gain)
            t[M + "shared_experts.down_proj.weight"] = _lin(g, D, Is)
    return t


def write_checkpoint(out_dir: str, overrides: dict | None = None, seed: int = 0, n_shards: int = 2,
                     **gains) -> str:
    tc = json.loads(json.dumps(NANO))
    for k, v in (overrides or {}).items():
        if k == "linear_attn_config":
            tc[k].update(v)
        else:
            tc[k] = v
    tensors = make_tensors(tc, seed, **gains)
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    per = math.ceil(len(names) / n_shards)
    for s in range(n_shards):
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    cfg = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "pad_token_id": 0,
        "text_config": tc,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                      "strategy": "group", "group_size": 32}}},
        },
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out_dir

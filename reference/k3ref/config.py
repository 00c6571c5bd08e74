"""`config.json` -> TextConfig (MODEL.md §1.1, Appendix A).

Every value is read from `text_config`; defaults are only used for fields that the released config omits and
that §0/§1 fix (e.g. k_norm eps).  Layer kinds come from the **1-indexed** `linear_attn_config` lists.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os


@dataclasses.dataclass
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    kda_layers: list  # 1-indexed, as stored
    full_attn_layers: list  # 1-indexed, as stored
    # MoE
    num_experts: int
    num_experts_per_token: int
    routed_expert_hidden_size: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool
    latent_moe_use_norm: bool
    situ_beta: float
    situ_linear_beta: float
    # AttnRes
    attn_res_block_size: int
    # DSA indexer (K3.1)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_rope_head_dim: int
    index_rope_theta: float
    index_k_norm_eps: float
    # special ids (avoid in test prompts)
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    raw: dict

    # ---- derived --------------------------------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        """0-indexed `layer` is KDA iff (layer+1) ∈ kda_layers (§1.1)."""
        return (layer + 1) in self.kda_layers

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _get(tc: dict, *names, default=None):
    for n in names:
        if n in tc and tc[n] is not None:
            return tc[n]
    return default


def parse_config(cfg: dict) -> TextConfig:
    tc = cfg.get("text_config", cfg)
    lac = tc["linear_attn_config"]
    n_layers = tc["num_hidden_layers"]
    kda_layers = list(lac.get("kda_layers") or [])
    full_layers = list(lac.get("full_attn_layers") or [])
    covered = sorted(kda_layers + full_layers)
    if covered != list(range(1, n_layers + 1)):
        raise ValueError(f"linear_attn_config lists must cover layers 1..{n_layers} exactly once, got {covered}")
    moe_inter = tc["moe_intermediate_size"]
    idx_rope = int(_get(tc, "index_rope_head_dim", default=0) or 0)
    if idx_rope == 0 and tc.get("indexer_rope") is True:
        idx_rope = tc["qk_rope_head_dim"]  # §0.1: `indexer_rope: true` without a width -> V3.2's rope width
    return TextConfig(
        hidden_size=tc["hidden_size"],
        num_hidden_layers=n_layers,
        vocab_size=tc["vocab_size"],
        rms_norm_eps=float(_get(tc, "rms_norm_eps", default=1e-5)),
        intermediate_size=tc["intermediate_size"],
        first_k_dense_replace=int(_get(tc, "first_k_dense_replace", default=1)),
        moe_layer_freq=int(_get(tc, "moe_layer_freq", default=1)),
        num_attention_heads=tc["num_attention_heads"],
        q_lora_rank=tc["q_lora_rank"],
        kv_lora_rank=tc["kv_lora_rank"],
        qk_nope_head_dim=tc["qk_nope_head_dim"],
        qk_rope_head_dim=tc["qk_rope_head_dim"],
        v_head_dim=tc["v_head_dim"],
        mla_use_output_gate=bool(_get(tc, "mla_use_output_gate", default=True)),
        kda_num_heads=lac["num_heads"],
        kda_head_dim=lac["head_dim"],
        conv_kernel=int(_get(lac, "short_conv_kernel_size", default=4)),
        gate_lower_bound=float(_get(lac, "gate_lower_bound", default=-5.0)),
        kda_layers=kda_layers,
        full_attn_layers=full_layers,
        num_experts=_get(tc, "num_experts", "n_routed_experts"),
        num_experts_per_token=_get(tc, "num_experts_per_token", "num_experts_per_tok"),
        routed_expert_hidden_size=tc["routed_expert_hidden_size"],
        moe_intermediate_size=moe_inter,
        num_shared_experts=int(_get(tc, "num_shared_experts", "n_shared_experts", default=0)),
        routed_scaling_factor=float(_get(tc, "routed_scaling_factor", default=1.0)),
        moe_renormalize=bool(_get(tc, "moe_renormalize", default=True)),
        latent_moe_use_norm=bool(_get(tc, "latent_moe_use_norm", default=True)),
        situ_beta=float(_get(tc, "activation_situ_beta", default=4.0)),
        situ_linear_beta=float(_get(tc, "activation_situ_linear_beta", default=25.0)),
        attn_res_block_size=tc["attn_res_block_size"],
        index_n_heads=int(_get(tc, "index_n_heads", default=0)),
        index_head_dim=int(_get(tc, "index_head_dim", default=0)),
        index_topk=int(_get(tc, "index_topk", default=0)),
        index_rope_head_dim=idx_rope,
        index_rope_theta=float(_get(tc, "index_rope_theta", "rope_theta", default=10000.0)),
        index_k_norm_eps=float(_get(tc, "index_k_norm_eps", default=1e-6)),
        bos_token_id=_get(tc, "bos_token_id", default=cfg.get("bos_token_id")),
        eos_token_id=_get(tc, "eos_token_id", default=cfg.get("eos_token_id")),
        pad_token_id=_get(tc, "pad_token_id", default=cfg.get("pad_token_id")),
        raw=tc,
    )


def load_config(ckpt_dir: str) -> TextConfig:
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        return parse_config(json.load(f))

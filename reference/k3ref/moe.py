"""MLPs: latent MoE with MXFP4 experts (MODEL.md §3.6) and the dense layer-0 MLP (§3.7)."""
from __future__ import annotations

import torch

from .numerics import bf16, lin, lin_nr, rmsnorm, situ_glu, topk_lower_index


def glu_mlp(x, w_gate, w_up, w_down, cfg):
    """`Lin(down)( SiTU(Lin(gate)(x), Lin(up)(x)) )` — dense layer 0 (§3.7) and the shared experts (§3.6.6)."""
    a = situ_glu(lin(x, w_gate), lin(x, w_up), cfg.situ_beta, cfg.situ_linear_beta)
    return lin(a, w_down)


def route(x, w_gate, bias, cfg):
    """§3.6.1 router, wide precision: s = σ(x·W_gateᵀ); select TopK(s + bias) (ties -> lower id); weights are
    the un-biased s of the selected experts, renormalised (Σ + 1e-20), times routed_scaling_factor.
    Returns (ids [T, K] int64 in selection order, weights [T, K], margin [T]) where margin = selection score
    of the K-th chosen expert minus that of the best unchosen one (≥ 0; 0 = exact tie)."""
    s = torch.sigmoid(lin_nr(x, w_gate))
    sel = s + bias if bias is not None else s
    K = cfg.num_experts_per_token
    order = topk_lower_index(sel, min(K + 1, sel.shape[-1]))
    ids = order[:, :K]
    srt = torch.gather(sel, 1, order)
    margin = srt[:, K - 1] - srt[:, K] if order.shape[1] > K else torch.full_like(srt[:, 0], torch.inf)
    w = torch.gather(s, 1, ids)
    if cfg.moe_renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor, margin


def moe_layer(ck, cfg, L: int, x: torch.Tensor, capture: dict | None = None) -> torch.Tensor:
    """x [T, hidden] normed (BF16 values) -> out [T, hidden] (BF16)."""
    p = "block_sparse_moe."
    T = x.shape[0]
    # 1. router (reads full-width x)
    ids, wts, margin = route(x, ck.layer(L, p + "gate.weight"), ck.layer_opt(L, p + "gate.e_score_correction_bias"), cfg)
    if capture is not None:
        capture["router_ids"] = ids.to(torch.int32)
        capture["router_weights"] = wts.to(torch.float32)
        capture["router_margin"] = margin.to(torch.float32)
    # 2. latent down-projection
    z = lin(x, ck.layer(L, p + "routed_expert_down_proj.weight"))       # [T, Lt] BF16
    # 3.+4. experts (gate/up GEMM outputs BF16, SiTU-GLU -> BF16, down -> BF16), late weighting, one rounding
    acc = torch.zeros_like(z)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        ze = z[tok]
        a = situ_glu(lin(ze, ck.expert(L, e, "w1")), lin(ze, ck.expert(L, e, "w3")),
                     cfg.situ_beta, cfg.situ_linear_beta)
        y = lin(a, ck.expert(L, e, "w2"))                                # [n, Lt] BF16
        acc.index_add_(0, tok, wts[tok, slot].unsqueeze(-1) * y)
    u = bf16(acc)
    # 5. routed_expert_norm, up-projection
    if cfg.latent_moe_use_norm:
        u = rmsnorm(u, ck.layer(L, p + "routed_expert_norm.weight"), cfg.rms_norm_eps)
    routed = lin(u, ck.layer(L, p + "routed_expert_up_proj.weight"))
    # 6. shared experts (fused into one GLU MLP)
    if cfg.num_shared_experts > 0:
        sh = glu_mlp(x, ck.layer(L, p + "shared_experts.gate_proj.weight"),
                     ck.layer(L, p + "shared_experts.up_proj.weight"),
                     ck.layer(L, p + "shared_experts.down_proj.weight"), cfg)
        return bf16(routed + sh)
    return routed


def dense_layer(ck, cfg, L: int, x: torch.Tensor) -> torch.Tensor:
    return glu_mlp(x, ck.layer(L, "mlp.gate_proj.weight"), ck.layer(L, "mlp.up_proj.weight"),
                   ck.layer(L, "mlp.down_proj.weight"), cfg)

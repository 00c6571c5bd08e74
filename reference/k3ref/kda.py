"""KDA layer (MODEL.md §3.3): short conv, L2-normed q/k, fine-grained (per key channel) forget gate, gated delta
rule.  The delta rule is given twice: the token-by-token recurrence (the definition, §3.3.6) and the chunked
WY/UT form used for prefill (C = 64); `tests/test_kda.py` shows they agree.

Shapes (per request): T new tokens, H heads, K = V = head_dim.
State per layer: `S` [H, K, V] (compute dtype), conv history `conv_{q,k,v}` [W-1, H·K] (pre-conv inputs, BF16
values), zero at sequence start.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import bf16, lin, rmsnorm_nr


# ---------------------------------------------------------------------------------------------------------
# §3.3.2 short causal depthwise conv + SiLU
# ---------------------------------------------------------------------------------------------------------
def short_conv(x: torch.Tensor, w: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`y_t[c] = Σ_{j=0..W-1} w[c,0,j] · x_{t-(W-1)+j}[c]`, then SiLU, one rounding to BF16.

    x: [T, C] pre-conv inputs (BF16 values); w: [C, 1, W]; hist: [W-1, C] previous inputs (zeros at start).
    Returns (y [T, C], new hist [W-1, C])."""
    W = w.shape[-1]
    full = torch.cat([hist, x], dim=0)  # [W-1+T, C]; row t+j holds x_{t-(W-1)+j}
    T = x.shape[0]
    y = torch.zeros_like(x)
    for j in range(W):
        y = y + w[:, 0, j] * full[j:j + T]
    y = bf16(F.silu(y))
    return y, full[T:].clone() if T >= 1 else hist


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """§3.3.3 `x / sqrt(Σx² + 1e-6)` over the head dim (eps inside the sqrt), no rounding."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------------
# §3.3.6 gated delta rule — recurrent form (the definition)
# ---------------------------------------------------------------------------------------------------------
def delta_rule_recurrent(q, k, v, g, beta, S0):
    """q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; S0: [H, K, V].  Per token, per head, in this order:
    `S ← diag(exp(g_t)) S`; `v' = β_t (v_t − Sᵀ k_t)`; `S ← S + k_t v'ᵀ`; `o_t = Sᵀ q_t`.
    Returns (o [T, H, V], S_T)."""
    S = S0.clone()
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t]).unsqueeze(-1)                      # decay key rows
        kS = torch.einsum("hk,hkv->hv", k[t], S)                   # Sᵀ k_t
        vp = beta[t].unsqueeze(-1) * (v[t] - kS)                   # v'
        S = S + k[t].unsqueeze(-1) * vp.unsqueeze(-2)              # S + k v'ᵀ
        outs.append(torch.einsum("hk,hkv->hv", q[t], S))           # Sᵀ q_t
    o = torch.stack(outs) if outs else q.new_zeros((0,) + v.shape[1:])
    return o, S


# ---------------------------------------------------------------------------------------------------------
# §3.3.6 gated delta rule — chunked WY/UT form
# ---------------------------------------------------------------------------------------------------------
def delta_rule_chunked(q, k, v, g, beta, S0, chunk: int = 64):
    """Same contract as `delta_rule_recurrent`, computed chunk by chunk (the last chunk may be shorter).

    Inside a chunk with start state S0 and cumulative log-decay Γ_t = Σ_{i≤t} g_i (per key channel), write
    the state as  S_t = diag(e^Γ_t) S0 + Σ_{i≤t} diag(e^(Γ_t−Γ_i)) k_i u_iᵀ  with u_t = v'_t.  Substituting
    into v'_t = β_t(v_t − (diag(e^g_t) S_{t−1})ᵀ k_t) gives the unit-lower-triangular system
        (I + A) U = diag(β) (V − (K ⊙ e^Γ) S0),   A[t,i] = β_t Σ_c k_t[c] k_i[c] e^(Γ_t[c]−Γ_i[c])  (i < t)
    (the UT transform; (I+A)⁻¹ is applied by forward substitution).  Then
        O = (Q ⊙ e^Γ) S0 + (M ∘ Q K̃ᵀ) U,   QK̃ᵀ[t,i] = Σ_c q_t[c] k_i[c] e^(Γ_t[c]−Γ_i[c])  (i ≤ t)
        S_C = diag(e^Γ_C) S0 + (K ⊙ e^(Γ_C−Γ))ᵀ U.
    Decay factors are formed from pairwise differences Γ_t−Γ_i ≤ 0, never as e^Γ_t / e^Γ_i, so nothing
    overflows even when Γ reaches −5·64."""
    T, H, K = q.shape
    S = S0.clone()
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[s:s + chunk] for x in (q, k, v, g, beta))
        c = qc.shape[0]
        G = torch.cumsum(gc, dim=0)                                     # [c, H, K]
        diff = G.unsqueeze(1) - G.unsqueeze(0)                          # [t, i, H, K] = Γ_t − Γ_i
        incl = torch.tril(torch.ones(c, c, dtype=torch.bool))          # i ≤ t
        strict = torch.tril(torch.ones(c, c, dtype=torch.bool), -1)    # i < t
        E_incl = torch.exp(torch.where(incl[:, :, None, None], diff, torch.full_like(diff, -torch.inf)))
        E_strict = E_incl * strict[:, :, None, None]
        A = torch.einsum("thc,ihc,tihc->hti", kc, kc, E_strict) * bc.T.unsqueeze(-1)   # [H, t, i]
        QK = torch.einsum("thc,ihc,tihc->hti", qc, kc, E_incl)                          # [H, t, i]
        eG = torch.exp(G)                                                              # [c, H, K]
        rhs = bc.T.unsqueeze(-1) * (vc.transpose(0, 1) - torch.einsum("thc,hcv->htv", kc * eG, S))
        IA = A + torch.eye(c, dtype=A.dtype)
        U = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)     # [H, c, V]
        O = torch.einsum("thc,hcv->htv", qc * eG, S) + QK @ U                          # [H, c, V]
        outs.append(O.transpose(0, 1))
        decay_to_end = torch.exp(G[-1].unsqueeze(0) - G)                                # [c, H, K]
        S = S * eG[-1].unsqueeze(-1) + torch.einsum("thc,htv->hcv", kc * decay_to_end, U)
    o = torch.cat(outs) if outs else q.new_zeros((0,) + v.shape[1:])
    return o, S


# ---------------------------------------------------------------------------------------------------------
# §3.3 whole layer
# ---------------------------------------------------------------------------------------------------------
def new_state(cfg, dtype):
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
    z = lambda: torch.zeros(W - 1, H * D, dtype=dtype)
    return {"S": torch.zeros(H, D, D, dtype=dtype), "conv_q": z(), "conv_k": z(), "conv_v": z()}


def kda_layer(ck, cfg, L: int, x: torch.Tensor, st: dict, mode: str = "chunked", chunk: int = 64):
    """x: [T, hidden] normed input (BF16 values).  Updates `st` in place.  Returns out [T, hidden] (BF16).
    mode: "chunked" (WY/UT, chunk C) or "recurrent"."""
    p = "self_attn."
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    T = x.shape[0]
    # 1. projections (BF16 outputs)
    qt = lin(x, ck.layer(L, p + "q_proj.weight"))
    kt = lin(x, ck.layer(L, p + "k_proj.weight"))
    vt = lin(x, ck.layer(L, p + "v_proj.weight"))
    # 2. short conv + SiLU, BF16
    q, st["conv_q"] = short_conv(qt, ck.layer(L, p + "q_conv1d.weight"), st["conv_q"])
    k, st["conv_k"] = short_conv(kt, ck.layer(L, p + "k_conv1d.weight"), st["conv_k"])
    v, st["conv_v"] = short_conv(vt, ck.layer(L, p + "v_conv1d.weight"), st["conv_v"])
    # 3. head reshape (head-major), L2 norm (after conv+SiLU), q scale D^-1/2 — wide, unrounded
    q = l2norm(q.view(T, H, D)) * D ** -0.5
    k = l2norm(k.view(T, H, D))
    v = v.view(T, H, D)
    # 4. forget gate: z = Lin(f_b)(Lin(f_a)(x)) + dt_bias; g = lb · σ(exp(A_log[h]) · z)   (A_log padded: first H)
    z = lin(lin(x, ck.layer(L, p + "f_a_proj.weight")), ck.layer(L, p + "f_b_proj.weight"))
    z = (z + ck.layer(L, p + "dt_bias")).view(T, H, D)
    A = torch.exp(ck.layer(L, p + "A_log").reshape(-1)[:H]).view(1, H, 1)
    g = cfg.gate_lower_bound * torch.sigmoid(A * z)
    # 5. β = σ(Lin(b_proj)(x))
    beta = torch.sigmoid(lin(x, ck.layer(L, p + "b_proj.weight")))      # [T, H]
    # 6. gated delta rule
    if mode == "recurrent":
        o, st["S"] = delta_rule_recurrent(q, k, v, g, beta, st["S"])
    else:
        o, st["S"] = delta_rule_chunked(q, k, v, g, beta, st["S"], chunk)
    # 7. per-head RMSNorm (FP32 weight shared by heads), then sigmoid gate; one rounding to BF16
    gate = torch.sigmoid(lin(x, ck.layer(L, p + "g_proj.weight"))).view(T, H, D)
    oh = bf16(rmsnorm_nr(o, ck.layer(L, p + "o_norm.weight"), cfg.rms_norm_eps) * gate)
    # 8. output projection
    return lin(oh.reshape(T, H * D), ck.layer(L, p + "o_proj.weight"))

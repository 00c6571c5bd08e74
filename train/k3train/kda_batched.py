"""Batched chunked gated delta rule (MODEL.md §3.3.6) for training and long-context evaluation on the GPU.

Same contract as `k3ref.kda.delta_rule_recurrent` (the definition), with a leading batch dim:
q, k, g fp32 [B, T, H, Dk]; v fp32 [B, T, H, Dk]; beta fp32 [B, T, H]; S0 fp32 [B, H, Dk, Dk]
-> (o fp32 [B, T, H, Dk], S_T fp32 [B, H, Dk, Dk]).  In the code K and V name the key and value widths (both Dk
here) and the chunking uses two trainer-local letters (docs/GLOSSARY.md): Nc chunks of Lc tokens.
tests/py/test_k3train.py checks it against the reference recurrence in float64.

Trick (the usual WY/UT decomposition, written for batched torch ops): inside a chunk of C tokens with
cumulative log-decay Γ_t (per key channel, Γ ≤ 0 relative to the chunk start),
    W = (I + A)⁻¹ diag(β) (K ⊙ e^Γ),   Ũ = (I + A)⁻¹ diag(β) V,   A[t,i] = β_t Σ_c k_t e^Γ_t · k_i e^−Γ_i (i < t)
so that the chunk's pseudo-values are U = Ũ − W S_n.  The state recurrence
    S_{n+1} = diag(e^Γ_C) S_n + (K ⊙ e^(Γ_C − Γ))ᵀ U_n  =  M_n S_n + b_n
is affine in S_n, so all chunk-start states come from a parallel prefix scan of the maps (M_n, b_n) — no
Python loop over chunks — and the outputs O = (Q ⊙ e^Γ) S_n + (mask ∘ (Q e^Γ)(K e^−Γ)ᵀ) U_n are batched.
The chunk is short (C = 16) because the factored form multiplies e^Γ by e^−Γ: with g ≥ −5 per token,
|Γ| ≤ 80 keeps both factors inside the FP32 range.  Computed in FP32 whatever the caller's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def delta_rule_chunked_batched(q, k, v, g, beta, S0=None, chunk: int = 16):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = torch.float32
    q, k, v, g, beta = q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt)
    if S0 is None:
        S0 = q.new_zeros(B, H, K, V)
    S0 = S0.to(dt)
    pad = (-T) % chunk
    if pad:
        # padded tokens: k = v = q = 0, g = 0, beta = 0 -> state and outputs unchanged
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, 0, 0, pad))
        g = F.pad(g, (0, 0, 0, 0, 0, pad))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // chunk
    C = chunk
    # fp32 [B, H, Nc, Lc, *]
    q = q.view(B, N, C, H, K).permute(0, 3, 1, 2, 4)
    k = k.view(B, N, C, H, K).permute(0, 3, 1, 2, 4)
    v = v.view(B, N, C, H, V).permute(0, 3, 1, 2, 4)
    g = g.view(B, N, C, H, K).permute(0, 3, 1, 2, 4)
    beta = beta.view(B, N, C, H).permute(0, 3, 1, 2)
    G = torch.cumsum(g, dim=3)                                   # Γ_t, ≤ 0
    eG, emG = torch.exp(G), torch.exp(-G)
    Kg, Km, Qg = k * eG, k * emG, q * eG
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    A = (Kg @ Km.transpose(-1, -2)) * beta.unsqueeze(-1)
    A = torch.where(strict, A, torch.zeros_like(A))
    IA = A + torch.eye(C, dtype=dt, device=q.device)
    rhs = torch.cat([beta.unsqueeze(-1) * Kg, beta.unsqueeze(-1) * v], dim=-1)   # fp32 [B, H, Nc, Lc, 2·Dk]
    sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
    W, Ut = sol[..., :K], sol[..., K:]
    QK = Qg @ Km.transpose(-1, -2)
    QK = torch.where(incl, QK, torch.zeros_like(QK))
    Gend = G[:, :, :, -1:, :]                                    # fp32 [B, H, Nc, 1, Dk]
    Kt = k * torch.exp(Gend - G)                                 # K ⊙ e^(Γ_C − Γ)
    dec = torch.exp(Gend.squeeze(3)).unsqueeze(-1)               # fp32 [B, H, Nc, Dk, 1]
    # Chunk-start states by a parallel prefix scan over chunks instead of a sequential loop: chunk n maps
    # S ↦ M_n S + b_n with M_n = diag(e^Γ_C) − K̃_nᵀ W_n and b_n = K̃_nᵀ Ũ_n (both [K, ·] per batch/head);
    # Hillis–Steele composition (log2 N batched matmul levels) gives every prefix map.
    Ktt = Kt.transpose(-1, -2)                                   # fp32 [B, H, Nc, Dk, Lc]
    M = torch.diag_embed(dec.squeeze(-1)) - Ktt @ W              # fp32 [B, H, Nc, Dk, Dk]
    bvec = Ktt @ Ut                                              # fp32 [B, H, Nc, Dk, Dk]
    off = 1
    while off < N:
        M_prev = torch.cat([torch.eye(K, dtype=dt, device=q.device).expand(B, H, off, K, K), M[:, :, :-off]], dim=2)
        b_prev = torch.cat([bvec.new_zeros(B, H, off, K, V), bvec[:, :, :-off]], dim=2)
        bvec = M @ b_prev + bvec
        M = M @ M_prev
        off *= 2
    S_after = M @ S0.unsqueeze(2) + bvec                         # fp32 [B, H, Nc, Dk, Dk] state after chunk n
    Sst = torch.cat([S0.unsqueeze(2), S_after[:, :, :-1]], dim=2)   # state at the start of chunk n
    S = S_after[:, :, -1]
    U = Ut - W @ Sst                                             # fp32 [B, H, Nc, Lc, Dk]
    O = Qg @ Sst + QK @ U                                        # fp32 [B, H, Nc, Lc, Dk]
    O = O.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return O, S

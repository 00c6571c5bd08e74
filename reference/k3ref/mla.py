"""Gated NoPE MLA (MODEL.md §3.4) with the K3.1 DSA lightning indexer (§3.5).

Per request and layer the state is the latent cache `latent` [S, C+R] (`[ĉ | k_pe]`, BF16 values) and the
index-key cache `ikey` [S, Di] (BF16 values), one row per token seen so far.

Two algebraically equal attention forms:
- "naive": k_nope, v = Lin(kv_b_proj)(ĉ) (BF16, recomputed from the latent cache), per-head softmax attention.
- "absorbed": MQA over the 576-wide cache: q̃_h = W_UK,hᵀ q_nope,h; s = q̃_h·ĉ + q_pe,h·k_pe; ô_h = Σ p ĉ;
  o_h = W_UV,h ô_h.  (q̃, ô kept wide.)
They differ only by the BF16 rounding of k_nope/v in the naive form (test: identical with rounding off).
The golden data uses the naive form.
"""
from __future__ import annotations


import torch

from .numerics import bf16, layernorm, lin, lin_nr, rmsnorm, topk_lower_index


def new_state(cfg, dtype):
    return {"latent": torch.zeros(0, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype),
            "ikey": torch.zeros(0, max(cfg.index_head_dim, 1), dtype=dtype)}


def has_indexer(ck, cfg, L: int) -> bool:
    return cfg.index_topk > 0 and ck.has(f"model.layers.{L}.self_attn.indexer.wk.weight")


# ---------------------------------------------------------------------------------------------------------
# §0.1 optional indexer RoPE (NeoX, rope part first); NoPE unless the config asks for it
# ---------------------------------------------------------------------------------------------------------
def rope_neox(x: torch.Tensor, pos: torch.Tensor, r: int, theta: float) -> torch.Tensor:
    """Rotate the first r dims of x[..., D] (non-interleaved halves) by position pos (shape [T]); BF16 out."""
    half = r // 2
    inv = theta ** (-torch.arange(half, dtype=x.dtype) * 2.0 / r)
    ang = pos.to(x.dtype).unsqueeze(-1) * inv                       # [T, half]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)                                       # broadcast over heads
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
    return bf16(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1))


# ---------------------------------------------------------------------------------------------------------
# §3.5 lightning indexer
# ---------------------------------------------------------------------------------------------------------
def indexer_qkw(ck, cfg, L, x, c_q, pos):
    """q_I [T, Hi, Di] = Lin(wq_b)(c_q); k_I [T, Di] = LayerNorm_k_norm(Lin(wk)(x)) (eps 1e-6, weight+bias);
    w [T, Hi] = weights_proj(x) in wide precision (no rounding)."""
    p = "self_attn.indexer."
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    T = x.shape[0]
    qI = lin(c_q, ck.layer(L, p + "wq_b.weight")).view(T, Hi, Di)
    kI = layernorm(lin(x, ck.layer(L, p + "wk.weight")), ck.layer(L, p + "k_norm.weight"),
                   ck.layer_opt(L, p + "k_norm.bias"), cfg.index_k_norm_eps)
    w = lin_nr(x, ck.layer(L, p + "weights_proj.weight"))
    if cfg.index_rope_head_dim > 0:
        qI = rope_neox(qI, pos, cfg.index_rope_head_dim, cfg.index_rope_theta)
        kI = rope_neox(kI, pos, cfg.index_rope_head_dim, cfg.index_rope_theta)
    return qI, kI, w


def indexer_select(cfg, qI, w, ikeys, pos):
    """Scores `I[t,s] = Σ_h w[t,h]·Hi^-½·Di^-½·ReLU(q_I[t,h]·k_I[s])` for s ≤ pos_t, then
    TopK(min(topk, pos_t+1)) with ties toward the lower key index.
    Returns (idx [T, topk] int64 in selection order, −1 padded; scores [T, S]; margin [T]) where margin =
    score of the last selected key minus the best unselected visible key (+inf when every visible key is
    selected; 0 = exact tie, decided by the lower-index rule)."""
    Hi, Di, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    S = ikeys.shape[0]
    dots = torch.relu(torch.einsum("thd,sd->ths", qI, ikeys))
    I = torch.einsum("th,ths->ts", w * (Hi ** -0.5 * Di ** -0.5), dots)
    causal = torch.arange(S).unsqueeze(0) <= pos.unsqueeze(1)           # [T, S]
    I = torch.where(causal, I, torch.full_like(I, -torch.inf))
    kk = min(topk, S)
    order = topk_lower_index(I, min(topk + 1, S))
    idx = order[:, :kk]                                                 # [T, kk]
    margin = torch.full((I.shape[0],), torch.inf, dtype=I.dtype)
    if order.shape[1] > topk:
        srt = torch.gather(I, 1, order)
        decided = (pos + 1) > topk
        margin = torch.where(decided, srt[:, topk - 1] - srt[:, topk], margin)
    n_valid = torch.clamp(pos + 1, max=topk).unsqueeze(1)              # min(topk, t+1)
    idx = torch.where(torch.arange(kk).unsqueeze(0) < n_valid, idx, torch.full_like(idx, -1))
    if kk < topk:
        idx = torch.cat([idx, torch.full((idx.shape[0], topk - kk), -1, dtype=idx.dtype)], dim=1)
    return idx, I, margin


def selection_mask(idx: torch.Tensor, S: int) -> torch.Tensor:
    """[T, topk] (−1 padded) -> bool [T, S]."""
    m = torch.zeros(idx.shape[0], S + 1, dtype=torch.bool)
    m.scatter_(1, torch.where(idx < 0, torch.full_like(idx, S), idx), True)
    return m[:, :S]


# ---------------------------------------------------------------------------------------------------------
# §3.4 attention cores
# ---------------------------------------------------------------------------------------------------------
def attn_naive(cfg, kv_b, q, latent, mask):
    """q [T, Hm, N+R]; latent [S, C+R]; mask bool [T, S].  Returns o [T, Hm, Dv] (BF16)."""
    Hm, N, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim, cfg.kv_lora_rank)
    S = latent.shape[0]
    kv = lin(latent[:, :C], kv_b).view(S, Hm, N + Dv)                   # BF16, heads outermost
    k_nope, v = kv[..., :N], kv[..., N:]
    k_pe = latent[:, C:]                                                 # shared by heads, not rotated
    s = (torch.einsum("thn,shn->hts", q[..., :N], k_nope)
         + torch.einsum("thr,sr->hts", q[..., N:], k_pe)) * (N + R) ** -0.5
    s = torch.where(mask.unsqueeze(0), s, torch.full_like(s, -torch.inf))
    p = torch.softmax(s, dim=-1)
    return bf16(torch.einsum("hts,shv->thv", p, v))


def attn_absorbed(cfg, kv_b, q, latent, mask):
    """Absorbed MQA form over the (C+R)-wide cache; same contract as `attn_naive`."""
    Hm, N, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim, cfg.kv_lora_rank)
    Wkv = kv_b.view(Hm, N + Dv, C)
    W_UK, W_UV = Wkv[:, :N, :], Wkv[:, N:, :]                           # [Hm, N, C], [Hm, Dv, C]
    q_abs = torch.einsum("thn,hnc->thc", q[..., :N], W_UK)              # q̃_h = W_UK,hᵀ q_nope,h
    q_full = torch.cat([q_abs, q[..., N:]], dim=-1)                     # [T, Hm, C+R]
    s = torch.einsum("thd,sd->hts", q_full, latent) * (N + R) ** -0.5
    s = torch.where(mask.unsqueeze(0), s, torch.full_like(s, -torch.inf))
    p = torch.softmax(s, dim=-1)
    o_lat = torch.einsum("hts,sc->thc", p, latent[:, :C])                # ô_h ∈ R^C
    return bf16(torch.einsum("thc,hvc->thv", o_lat, W_UV))


# ---------------------------------------------------------------------------------------------------------
# §3.4 + §3.5 whole layer
# ---------------------------------------------------------------------------------------------------------
def mla_layer(ck, cfg, L: int, x: torch.Tensor, st: dict, form: str = "naive", topk_override=None,
              capture: dict | None = None):
    """x: [T, hidden] normed input for T new tokens at positions len(cache)..; updates the caches in `st`.
    Returns out [T, hidden] (BF16).  capture["index_topk"] receives the selected key ids (ascending, −1
    padded) when the layer has an indexer."""
    p = "self_attn."
    Hm, N, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim, cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    T = x.shape[0]
    start = st["latent"].shape[0]
    pos = torch.arange(start, start + T)
    # 1. query path
    c_q = rmsnorm(lin(x, ck.layer(L, p + "q_a_proj.weight")), ck.layer(L, p + "q_a_layernorm.weight"), eps)
    q = lin(c_q, ck.layer(L, p + "q_b_proj.weight")).view(T, Hm, N + R)
    # 2. latent: [c | k_pe]; ĉ = RMSNorm(c); k_pe neither normed nor rotated
    ckv = lin(x, ck.layer(L, p + "kv_a_proj_with_mqa.weight"))
    c_hat = rmsnorm(ckv[:, :C], ck.layer(L, p + "kv_a_layernorm.weight"), eps)
    st["latent"] = torch.cat([st["latent"], torch.cat([c_hat, ckv[:, C:]], dim=-1)], dim=0)
    S = st["latent"].shape[0]
    causal = torch.arange(S).unsqueeze(0) <= pos.unsqueeze(1)
    # 3. (K3.1) indexer -> sparse key set per query
    mask = causal
    if has_indexer(ck, cfg, L):
        qI, kI, w = indexer_qkw(ck, cfg, L, x, c_q, pos)
        st["ikey"] = torch.cat([st["ikey"], kI], dim=0)
        if topk_override is not None:
            cfg_sel = _with_topk(cfg, topk_override)
        else:
            cfg_sel = cfg
        idx, _, margin = indexer_select(cfg_sel, qI, w, st["ikey"], pos)
        mask = selection_mask(idx, S) & causal
        if capture is not None:
            srt = torch.sort(torch.where(idx < 0, torch.full_like(idx, 1 << 40), idx), dim=1).values
            capture["index_topk"] = torch.where(srt == (1 << 40), torch.full_like(srt, -1), srt).to(torch.int32)
            capture["index_margin"] = margin.to(torch.float32)
    # 4. attention
    kv_b = ck.layer(L, p + "kv_b_proj.weight")
    core = attn_naive if form == "naive" else attn_absorbed
    o = core(cfg, kv_b, q, st["latent"], mask)                          # [T, Hm, Dv] BF16
    # 5. sigmoid output gate (wide product, one rounding), o_proj
    o = o.reshape(T, Hm * Dv)
    if cfg.mla_use_output_gate:
        o = bf16(o * torch.sigmoid(lin(x, ck.layer(L, p + "g_proj.weight"))))
    return lin(o, ck.layer(L, p + "o_proj.weight"))


def _with_topk(cfg, k):
    import dataclasses
    return dataclasses.replace(cfg, index_topk=k)

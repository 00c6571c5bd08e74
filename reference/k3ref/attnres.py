"""AttnRes, the residual stream replacement (MODEL.md §3.2).  Token-local: no state across calls."""
from __future__ import annotations

import torch

from .numerics import bf16


def mix(sources: list, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """`Mix(v_0..v_n)`: u = norm_w ⊙ proj_w; ℓ_i = (v_i·u)·rsqrt(mean(v_i²) + ε); α = softmax(ℓ);
    h = Σ α_i v_i over the raw sources, computed wide and rounded to BF16 once (NeMo rounds the Mix result
    before the following RMSNorm).  A single source is returned exactly.
    sources: list of [T, D]; weights [D] and [1, D]."""
    if len(sources) == 1:
        return sources[0]
    V = torch.stack(sources)                                             # [n, T, D]
    u = norm_w.reshape(-1) * proj_w.reshape(-1)
    logits = (V @ u) * torch.rsqrt(V.pow(2).mean(-1) + eps)             # [n, T]
    alpha = torch.softmax(logits, dim=0)
    return bf16((alpha.unsqueeze(-1) * V).sum(0))

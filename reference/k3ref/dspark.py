"""DSpark draft model (MODEL.md §5, §0.5), one request at a time, and the verification rules.

    target = Model(target_dir); target.tap_layers = draft.cfg.target_layer_ids
    draft = Draft(draft_dir, target)
    st = draft.new_state()
    target.prefill(prompt, tst); draft.inject(target.last_taps, st)    # context = positions 0..p-1
    hn = draft.block_hidden([anchor] + [mask] * (N - 1), st)          # [N, D], after final_norm
    logits_i = draft.markov_logits(hn[i], prev_i, topk)                 # [V] float32

Draft checkpoint (kestrel's layout; the preview's tensor names are not public, see docs/speculative.md):
`config.json` (`model_type "k3_dspark"`) and `model.safetensors` with
`context_proj.weight` [D, n·Dt], `context_norm.weight` [D], per layer ℓ `layers.ℓ.input_layernorm.weight`,
`layers.ℓ.post_attention_layernorm.weight` [D], `layers.ℓ.self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight` (§3.4 shapes, no g_proj),
`layers.ℓ.mlp.{gate_proj, up_proj, down_proj}.weight`, `norm.weight` [D], `markov_w1.weight` [V, r],
`markov_w2.weight` [V, r].  Embedding and lm_head are the target's.

State = per draft layer the latent cache [S, C+R] (ĉ | RoPE-rotated k_pe) of the context positions.  The
block's own latent rows are attended to (non-causal inside the block) but never stored: the next step's
context injection writes the real rows for the accepted positions.
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors import safe_open

from .numerics import bf16, lin, lin_nr, rmsnorm, topk_lower_index


class DraftConfig:
    def __init__(self, raw: dict):
        self.raw = raw
        if raw.get("model_type") != "k3_dspark":
            raise ValueError(f"draft config model_type is {raw.get('model_type')!r}, expected 'k3_dspark'")
        g = raw.get
        self.hidden_size = raw["hidden_size"]
        self.intermediate_size = raw["intermediate_size"]
        self.num_hidden_layers = raw["num_hidden_layers"]
        self.num_attention_heads = raw["num_attention_heads"]
        self.q_lora_rank = raw["q_lora_rank"]
        self.kv_lora_rank = raw["kv_lora_rank"]
        self.qk_nope_head_dim = raw["qk_nope_head_dim"]
        self.qk_rope_head_dim = raw["qk_rope_head_dim"]
        self.v_head_dim = raw["v_head_dim"]
        self.vocab_size = raw["vocab_size"]
        self.rms_norm_eps = float(g("rms_norm_eps", 1e-5))
        self.hidden_act = g("hidden_act", "silu")
        self.rope_theta = float(g("rope_theta", 50000.0))
        self.rope_scaling = g("rope_scaling")
        self.target_layer_ids = list(raw["target_layer_ids"])
        self.target_hidden_size = int(g("target_hidden_size", self.hidden_size))
        self.mask_token_id = int(raw["mask_token_id"])
        self.markov_rank = int(g("markov_rank", 0))
        self.block_size = int(g("num_speculative_tokens", 7))
        if self.hidden_act != "silu":
            raise ValueError(f"draft hidden_act {self.hidden_act!r}: only 'silu' is specified (MODEL.md §5)")
        if g("mla_use_output_gate", False) or g("mla_use_nope", False):
            raise ValueError("draft MLA has RoPE and no output gate (MODEL.md §5)")


# ---------------------------------------------------------------------------------------------------------
# §5 RoPE: interleaved (GPT-J pairs), FP32 cos/sin, DeepSeek-YaRN
# ---------------------------------------------------------------------------------------------------------
def _yarn_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def rope_tables(cfg: DraftConfig):
    """(inv_freq float32 [R/2], cos/sin multiplier, softmax scale).  inv_freq is computed in float64 and
    rounded to float32 once; the C++ engine does the same."""
    R = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    i = torch.arange(0, R, 2, dtype=torch.float64)
    pos_freqs = base ** (i / R)
    inv = 1.0 / pos_freqs
    scale = (cfg.qk_nope_head_dim + R) ** -0.5
    mul = 1.0
    rs = cfg.rope_scaling
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        factor = float(rs["factor"])
        orig = float(rs["original_max_position_embeddings"])
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))
        mscale, mscale_all = float(rs.get("mscale", 1.0)), float(rs.get("mscale_all_dim", 0.0))

        def corr_dim(rot):
            return (R * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), R - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extra_mask = 1.0 - ramp                                   # 1: keep the original frequency
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra_mask) + inv * extra_mask
        mul = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        if mscale_all:
            scale *= _yarn_mscale(factor, mscale_all) ** 2
    elif rs:
        raise ValueError(f"draft rope_scaling {rs!r}: only yarn is supported")
    return inv.to(torch.float32), float(mul), scale


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, mul: float) -> torch.Tensor:
    """x [T, ..., R] in the compute dtype; pairs (2i, 2i+1) rotated by pos·inv[i] (FP32 angle and cos/sin,
    times `mul`), result rounded to BF16."""
    ang = pos.to(torch.float32).unsqueeze(-1) * inv               # [T, R/2] float32
    cos = (torch.cos(ang) * torch.tensor(mul, dtype=torch.float32)).to(x.dtype)
    sin = (torch.sin(ang) * torch.tensor(mul, dtype=torch.float32)).to(x.dtype)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
    return bf16(out)


# ---------------------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------------------
class Draft:
    def __init__(self, draft_dir: str, target, dtype=torch.float64):
        with open(os.path.join(draft_dir, "config.json")) as f:
            self.cfg = DraftConfig(json.load(f))
        self.dir = draft_dir
        self.target = target
        self.dtype = dtype
        tc = target.cfg
        if self.cfg.hidden_size != tc.hidden_size or self.cfg.vocab_size != tc.vocab_size:
            raise ValueError("draft hidden/vocab must equal the target's (embedding and lm_head are shared)")
        if self.cfg.target_hidden_size != tc.hidden_size:
            raise ValueError("target_hidden_size differs from the target's hidden_size")
        for L in self.cfg.target_layer_ids:
            if not 0 <= L < tc.num_hidden_layers:
                raise ValueError(f"target_layer_ids entry {L} outside the target's layers")
        self._t: dict = {}
        with safe_open(os.path.join(draft_dir, "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                self._t[k] = f.get_tensor(k).to(dtype)
        self.inv, self.mul, self.scale = rope_tables(self.cfg)

    def w(self, name):
        return self._t[name]

    def new_state(self) -> dict:
        cw = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        return {"pos": 0, "latent": [torch.zeros(0, cw, dtype=self.dtype) for _ in range(self.cfg.num_hidden_layers)]}

    # ---- §5 context projection and KV injection --------------------------------------------------------
    def latent_rows(self, l: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[ĉ | RoPE(k_pe)] of layer l for inputs x [T, D] at positions pos."""
        C = self.cfg.kv_lora_rank
        p = f"layers.{l}.self_attn."
        ckv = lin(x, self.w(p + "kv_a_proj_with_mqa.weight"))
        c_hat = rmsnorm(ckv[:, :C], self.w(p + "kv_a_layernorm.weight"), self.cfg.rms_norm_eps)
        k_pe = rope_interleaved(ckv[:, C:], pos, self.inv, self.mul)
        return torch.cat([c_hat, k_pe], dim=-1)

    def inject(self, taps: torch.Tensor, st: dict, capture: dict | None = None):
        """taps [T, n·Dt] (the target's AttnRes partial sums after the tap layers, concatenated) of the
        positions st["pos"].. ; appends their latent rows to every draft layer's cache."""
        eps = self.cfg.rms_norm_eps
        T = taps.shape[0]
        pos = torch.arange(st["pos"], st["pos"] + T)
        h_ctx = rmsnorm(lin(taps, self.w("context_proj.weight")), self.w("context_norm.weight"), eps)
        for l in range(self.cfg.num_hidden_layers):
            rows = self.latent_rows(l, h_ctx, pos)
            st["latent"][l] = torch.cat([st["latent"][l], rows], dim=0)
            if capture is not None:
                capture[f"D{l}.ctx_latent"] = rows
        if capture is not None:
            capture["h_ctx"] = h_ctx
        st["pos"] += T

    # ---- §5 draft layers over the non-causal block -----------------------------------------------------
    def _mla(self, l: int, x: torch.Tensor, st: dict, pos: torch.Tensor, cap) -> torch.Tensor:
        cfg = self.cfg
        Hm, N, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                           cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        p = f"layers.{l}.self_attn."
        T = x.shape[0]
        c_q = rmsnorm(lin(x, self.w(p + "q_a_proj.weight")), self.w(p + "q_a_layernorm.weight"), eps)
        q = lin(c_q, self.w(p + "q_b_proj.weight")).view(T, Hm, N + R)
        q = torch.cat([q[..., :N], rope_interleaved(q[..., N:], pos, self.inv, self.mul)], dim=-1)
        block_rows = self.latent_rows(l, x, pos)
        latent = torch.cat([st["latent"][l], block_rows], dim=0)        # context rows, then the block's
        S = latent.shape[0]
        kv = lin(latent[:, :C], self.w(p + "kv_b_proj.weight")).view(S, Hm, N + Dv)
        k_nope, v = kv[..., :N], kv[..., N:]
        s = (torch.einsum("thn,shn->hts", q[..., :N], k_nope)
             + torch.einsum("thr,sr->hts", q[..., N:], latent[:, C:])) * self.scale
        prob = torch.softmax(s, dim=-1)                                  # every key: non-causal block
        o = bf16(torch.einsum("hts,shv->thv", prob, v)).reshape(T, Hm * Dv)
        if cap is not None:
            cap[f"D{l}.block_latent"] = block_rows
        return lin(o, self.w(p + "o_proj.weight"))

    def _mlp(self, l: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{l}.mlp."
        g = lin(x, self.w(p + "gate_proj.weight"))
        u = lin(x, self.w(p + "up_proj.weight"))
        a = bf16(g * torch.sigmoid(g) * u)                              # SwiGLU in the compute dtype
        return lin(a, self.w(p + "down_proj.weight"))

    def block_hidden(self, block_tokens, st: dict, capture: dict | None = None) -> torch.Tensor:
        """block_tokens [N] at positions st["pos"]..+N-1 (anchor, then mask ids); returns the final-normed
        hidden states [N, D].  Does not change st."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        toks = torch.as_tensor(list(block_tokens), dtype=torch.int64)
        T = toks.numel()
        pos = torch.arange(st["pos"], st["pos"] + T)
        h = self.target.ck.get("model.embed_tokens.weight")[toks]
        for l in range(cfg.num_hidden_layers):
            p = f"layers.{l}."
            a = self._mla(l, rmsnorm(h, self.w(p + "input_layernorm.weight"), eps), st, pos, capture)
            h = bf16(h + a)
            m = self._mlp(l, rmsnorm(h, self.w(p + "post_attention_layernorm.weight"), eps))
            h = bf16(h + m)
            if capture is not None:
                capture[f"D{l}.attn_out"] = a
                capture[f"D{l}.mlp_out"] = m
                capture[f"D{l}.hidden"] = h
        hn = rmsnorm(h, self.w("norm.weight"), eps)
        if capture is not None:
            capture["block_normed"] = hn
        return hn

    # ---- §5 Markov head ---------------------------------------------------------------------------------
    def base_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """lm_head(h) [.., V], wide (the target's lm_head on the draft's normed state)."""
        return lin_nr(hn, self.target.ck.get("lm_head.weight"))

    def markov_logits(self, hn_i: torch.Tensor, prev: int, topk: int = 0) -> torch.Tensor:
        """logits_i = lm_head(h_i) + W2·W1[prev]; with topk > 0 only the base top-k keep a value."""
        base = self.base_logits(hn_i)
        corr = lin_nr(self.w("markov_w1.weight")[prev], self.w("markov_w2.weight"))
        out = base + corr
        if topk > 0:
            keep = topk_lower_index(base, topk)
            masked = torch.full_like(out, -torch.inf)
            masked[keep] = out[keep]
            out = masked
        return out.to(torch.float32)

    def draft_greedy(self, anchor: int, st: dict, topk: int = 0, capture: dict | None = None):
        """Greedy Markov chain over the block: returns (tokens [N], logits [N, V] float32)."""
        N = self.cfg.block_size
        hn = self.block_hidden([anchor] + [self.cfg.mask_token_id] * (N - 1), st, capture)
        prev, toks, logits = anchor, [], []
        for i in range(N):
            lg = self.markov_logits(hn[i], prev, topk)
            nxt = int(topk_lower_index(lg, 1)[0])
            toks.append(nxt)
            logits.append(lg)
            prev = nxt
        return toks, torch.stack(logits)

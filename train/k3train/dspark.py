"""The DSpark draft (MODEL.md §5) for training: many draft blocks of many rows at once, teacher forced.

One definition with the reference: the forward is reference/k3ref/dspark.py's (`Draft.inject`,
`Draft.block_hidden`, `Draft.markov_logits`) with k3ref's own `rmsnorm`, `bf16`, `rope_tables` and
`rope_interleaved`, and §3 "Lin" for every linear map (BF16 operands, FP32 accumulation, BF16 output; the
trainer's `model.lin`).  tests/py/test_k3train_dspark.py checks it against the reference on random weights.

What is batched here and per request there: a training row of T tokens has the target's taps at every
position; the context path (context projection, context_norm, each draft layer's kv_a projection, kv_a
layernorm and RoPE'd k_pe) runs once over all T positions, and `nb` draft blocks per row are evaluated
together.  Block b anchored at position p is `[x_p, mask × (N−1)]` at positions p..p+N−1; its queries attend to
the context rows 0..p−1 (the rows the serving draft's cache holds when x_p is the anchor) and to all N rows
of their own block (non-causal inside the block), never to other blocks — one boolean mask over
[context rows | every block's rows] per row, one SDPA call per layer.

Markov head, teacher forced: `logits_i = lm_head(h_i) + W2·W1[prev_i]` with prev_0 = x_p and prev_i = x_{p+i}
(the true previous token); position i predicts x_{p+1+i}.  Both GEMMs run as one over the concatenation
[h_i | W1[prev_i]] · [lm_head | W2]ᵀ, wide (no output rounding, like `lin_nr`).

The target's embedding and lm_head are inputs (frozen), not parameters.  Parameters are FP32 master weights
named exactly like reference/make_draft.py's tensors (state_dict keys = checkpoint names, '.' → '__'), used
rounded to BF16 (`b16`, straight-through); `export` writes them as BF16 safetensors with make_draft.py's
config.json.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
_REF = os.path.abspath(os.path.join(_HERE, "..", "..", "reference"))
if _REF not in sys.path:
    sys.path.insert(0, _REF)

import make_draft  # noqa: E402
from k3ref.dspark import DraftConfig, rope_interleaved, rope_tables  # noqa: E402
from k3ref.numerics import bf16, rmsnorm  # noqa: E402

from .model import _init, b16, lin  # noqa: E402

SHARD_BYTES = 15 * 1024 * 1024

# The k3-tiny draft: make_draft.py's nano widths (hidden 256 = k3-tiny's, 4 heads, q/kv LoRA 64, nope/rope/v
# 32/16/32, FFN 512) with two layers, the released block of 7, a rank-32 Markov head, and five taps spread over
# k3-tiny's 8 layers exactly like the mini preset's (after layers 1, 2, 4, 5, 7: the three complete AttnRes
# block sums 2, 5, 7 and the partial sums 1, 4).  RoPE: θ 10,000, DeepSeek-YaRN ×8 over the 2,048-token training
# rows (the eval prompts reach 4,096).  mask_token_id: k3-tiny's reserved special slot 253 (12,253).
TINY_DRAFT = {
    "vocab_size": 12256, "hidden_size": 256, "target_hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "markov_rank": 32,
    "num_speculative_tokens": 7, "target_layer_ids": [1, 2, 4, 5, 7], "mask_token_id": 12253,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def draft_config(overrides: dict | None = None) -> dict:
    """config.json of the k3-tiny draft, built by make_draft.py's own builder (same fields as its presets)."""
    over = dict(TINY_DRAFT)
    over.update(overrides or {})
    return make_draft.draft_config("nano", list(over.items()))


def param_shapes(cfg: dict) -> dict:
    """name -> (shape, init kind): make_draft.py's inventory (the engine's names and shapes)."""
    out = {}
    L = cfg["num_hidden_layers"]
    gain = 1.0 / math.sqrt(2 * L)
    for t in make_draft.inventory(cfg):
        if t.name.endswith(("norm.weight", "layernorm.weight")):
            kind = "one"
        elif t.name == "markov_w1.weight":
            kind = "embed"  # unit normal, as the target's embedding table (model._init)
        elif t.name == "markov_w2.weight":
            kind = "zero"                              # the correction starts at zero: base logits only
        elif t.name.endswith(("o_proj.weight", "down_proj.weight")):
            kind = ("lin", gain)
        else:
            kind = "lin"
        out[t.name] = (tuple(t.shape), kind)
    return out


class DSparkDraft(nn.Module):
    def __init__(self, cfg: dict, seed: int = 0):
        super().__init__()
        self.raw = cfg
        self.cfg = DraftConfig(cfg)
        g = torch.Generator().manual_seed(seed)
        self.names = []
        self.params = nn.ParameterDict()
        for name, (shape, kind) in param_shapes(cfg).items():
            self.params[name.replace(".", "__")] = nn.Parameter(_init(shape, kind, g))
            self.names.append(name)
        inv, self.rope_mul, self.scale = rope_tables(self.cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def w(self, name):
        """A BF16 tensor of the checkpoint as FP32 holding BF16 values (norm weights)."""
        return b16(self.p(name)).float()

    def named_master(self):
        for n in self.names:
            yield n, self.p(n)

    def load_dir(self, draft_dir):
        """Load a draft checkpoint (config must match) — tests, and continuing from an export."""
        from safetensors import safe_open
        files = sorted(f for f in os.listdir(draft_dir) if f.endswith(".safetensors"))
        with torch.no_grad():
            for fn in files:
                with safe_open(os.path.join(draft_dir, fn), framework="pt") as f:
                    for k in f.keys():
                        self.p(k).copy_(f.get_tensor(k).float())
        return self

    def _rope(self, x, pos):
        return rope_interleaved(x, pos, self.inv_freq, self.rope_mul)

    # ---- §5 context projection and KV injection (every row's positions at once) --------------------------
    def latent(self, l, x, pos):
        """[ĉ | RoPE(k_pe)] of layer l: x [..., D] at positions pos [...] -> [..., C+R]."""
        C, eps = self.cfg.kv_lora_rank, self.cfg.rms_norm_eps
        A = f"layers.{l}.self_attn."
        ckv = lin(x, self.p(A + "kv_a_proj_with_mqa.weight"))
        c_hat = rmsnorm(ckv[..., :C], self.w(A + "kv_a_layernorm.weight"), eps)
        return torch.cat([c_hat, self._rope(ckv[..., C:], pos)], dim=-1)

    def context(self, taps):
        """taps [B, T, n·Dt] (BF16 values) -> per draft layer the context latent rows [B, T, C+R]."""
        B, T, _ = taps.shape
        h_ctx = rmsnorm(lin(taps, self.p("context_proj.weight")), self.w("context_norm.weight"),
                        self.cfg.rms_norm_eps)
        pos = torch.arange(T, device=taps.device).expand(B, T)
        return [self.latent(l, h_ctx, pos) for l in range(self.cfg.num_hidden_layers)]

    # ---- §5 draft layers over the non-causal blocks ------------------------------------------------------
    def _mla(self, l, x, ctx_lat, bpos, mask):
        """x [B, nb, N, D] normed block inputs; ctx_lat [B, T, C+R]; bpos [B, nb, N]; mask [B, nb·N, T + nb·N]."""
        cfg = self.cfg
        Hm, Nn, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        A = f"layers.{l}.self_attn."
        B, nb, N, _ = x.shape
        T = ctx_lat.shape[1]
        c_q = rmsnorm(lin(x, self.p(A + "q_a_proj.weight")), self.w(A + "q_a_layernorm.weight"), eps)
        q = lin(c_q, self.p(A + "q_b_proj.weight")).view(B, nb, N, Hm, Nn + R)
        q = torch.cat([q[..., :Nn], self._rope(q[..., Nn:], bpos)], dim=-1)
        blk_lat = self.latent(l, x, bpos).reshape(B, nb * N, C + R)
        lat = torch.cat([ctx_lat, blk_lat], dim=1)                           # [B, S, C+R], S = T + nb·N
        S = lat.shape[1]
        kv = lin(lat[..., :C], self.p(A + "kv_b_proj.weight")).view(B, S, Hm, Nn + Dv)
        k = torch.cat([kv[..., :Nn], lat[..., C:].unsqueeze(2).expand(B, S, Hm, R)], dim=-1)
        v = kv[..., Nn:]
        adt = torch.float32 if x.device.type == "cpu" else torch.bfloat16
        qb = q.reshape(B, nb * N, Hm, Nn + R).transpose(1, 2).to(adt)      # [B, Hm, nb·N, Nn+R]
        kb, vb = k.transpose(1, 2).to(adt), v.transpose(1, 2).to(adt)       # [B, Hm, S, *]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask.unsqueeze(1), scale=self.scale)
        o = bf16(o.transpose(1, 2).float()).reshape(B, nb, N, Hm * Dv)
        return lin(o, self.p(A + "o_proj.weight"))

    def _mlp(self, l, x):
        P = f"layers.{l}.mlp."
        g = lin(x, self.p(P + "gate_proj.weight"))
        u = lin(x, self.p(P + "up_proj.weight"))
        return lin(bf16(g * torch.sigmoid(g) * u), self.p(P + "down_proj.weight"))

    def block_mask(self, anchors, T):
        """anchors [B, nb] -> bool [B, nb·N, T + nb·N]: context keys before the block's anchor, own block's keys."""
        B, nb = anchors.shape
        N = self.cfg.block_size
        dev = anchors.device
        qa = anchors.repeat_interleave(N, dim=1)                                      # [B, nb·N]
        ctx = torch.arange(T, device=dev).view(1, 1, T) < qa.unsqueeze(-1)            # [B, nb·N, T]
        bid = torch.arange(nb, device=dev).repeat_interleave(N)                       # [nb·N]
        own = (bid.view(-1, 1) == bid.view(1, -1)).unsqueeze(0).expand(B, -1, -1)    # [B, nb·N, nb·N]
        return torch.cat([ctx, own], dim=-1)

    def block_hidden(self, embed, taps, ids, anchors):
        """embed [V, D] (the target's, BF16 values), taps [B, T, n·Dt], ids [B, T], anchors [B, nb] (0 ≤ p < T)
        -> final-normed hidden states [B, nb, N, D] of every block."""
        cfg = self.cfg
        eps, N = cfg.rms_norm_eps, cfg.block_size
        B, T = ids.shape
        ctx = self.context(taps)
        bpos = anchors.unsqueeze(-1) + torch.arange(N, device=ids.device)            # [B, nb, N]
        toks = torch.full_like(bpos, cfg.mask_token_id)
        toks[..., 0] = torch.gather(ids, 1, anchors)
        h = embed[toks].float()                                                       # [B, nb, N, D]
        mask = self.block_mask(anchors, T)
        for l in range(cfg.num_hidden_layers):
            P = f"layers.{l}."
            h = bf16(h + self._mla(l, rmsnorm(h, self.w(P + "input_layernorm.weight"), eps), ctx[l], bpos, mask))
            h = bf16(h + self._mlp(l, rmsnorm(h, self.w(P + "post_attention_layernorm.weight"), eps)))
        return rmsnorm(h, self.w("norm.weight"), eps)

    def markov_logits(self, hn, prev, lm_head):
        """hn [..., D], prev [...] (previous token ids), lm_head [V, D] -> FP32 logits [..., V]:
        lm_head(h) + W2·W1[prev], wide."""
        a = torch.cat([hn, self.w("markov_w1.weight")[prev]], dim=-1)
        wcat = torch.cat([lm_head.float(), self.w("markov_w2.weight")], dim=-1)
        return a @ wcat.t()

    def forward(self, embed, lm_head, taps, ids, anchors):
        """Teacher-forced logits [B, nb, N, V]: position i of the block at p predicts x_{p+1+i} with
        prev_i = x_{p+i} (ids past the row's end read as the mask token; their loss weight is zero)."""
        N = self.cfg.block_size
        B, T = ids.shape
        hn = self.block_hidden(embed, taps, ids, anchors)
        pos = anchors.unsqueeze(-1) + torch.arange(N, device=ids.device)
        prev = torch.gather(ids, 1, pos.clamp(max=T - 1).view(B, -1)).view_as(pos)
        prev = torch.where(pos < T, prev, torch.full_like(prev, self.cfg.mask_token_id))
        return self.markov_logits(hn, prev, lm_head)


def export(draft: DSparkDraft, out_dir: str) -> int:
    """config.json + BF16 safetensors with make_draft.py's names: one model.safetensors when it fits in
    SHARD_BYTES (the k3-tiny draft does), else shards + model.safetensors.index.json (the engine reads both;
    reference/k3ref/dspark.py reads the single file).  Returns the bytes of tensors written."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(draft.raw, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in draft.named_master()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for fn in os.listdir(out_dir):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, fn))
    if total <= SHARD_BYTES:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return total
    shards, cur, size = [], {}, 0
    for n in sorted(tensors):
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = tensors[n]
        size += nbytes
    shards.append(cur)
    wm = {}
    for i, part in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(out_dir, fn), metadata={"format": "pt"})
        wm.update({n: fn for n in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2, sort_keys=True)
    return total

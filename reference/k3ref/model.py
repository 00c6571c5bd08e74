"""The K3.1 text model (MODEL.md §3), one request at a time, with state across calls.

    m = Model(ckpt_dir)
    st = m.new_state()
    logits = m.prefill(tokens, st)      # [T, V] float32
    logits = m.decode(token, st)        # [V]    float32
    # prefill(N) followed by M decode steps == prefill(N+M)   (tests/test_model.py)

State (per request) = position count, per KDA layer the recurrent state S [H, K, V] and conv histories, per MLA
layer the latent cache [S, C+R] and the index-key cache [S, Di].  AttnRes is token-local (no state).

`capture` (optional dict) receives, for the tokens of the call: `L{L}.attn_in`, `L{L}.attn_out`, `L{L}.mlp_in`,
`L{L}.mlp_out` [T, D]; `L{L}.index_topk` [T, topk] (MLA layers with an indexer); `L{L}.router_ids` /
`L{L}.router_weights` [T, K], `L{L}.router_margin` [T] (MoE layers); `L{L}.index_margin` [T]
(MLA layers); `final_hidden` [T, D]; `logits` [T, V].
"""
from __future__ import annotations

import torch

from . import kda, mla
from .attnres import mix
from .loader import Checkpoint
from .moe import dense_layer, moe_layer
from .numerics import bf16, lin_nr, rmsnorm


class Model:
    def __init__(self, ckpt, dtype=torch.float64, mla_form: str = "naive", kda_mode: str | None = None,
                 kda_chunk: int = 64, topk_override: int | None = None):
        """ckpt: directory or Checkpoint.  dtype: compute dtype (float64 default, float32 allowed).
        mla_form: "naive" | "absorbed".  kda_mode: None (chunked for T > 1, recurrent for T == 1),
        "chunked" or "recurrent".  topk_override: replace index_topk (tests only)."""
        self.ck = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt, dtype)
        self.cfg = self.ck.cfg
        self.dtype = self.ck.dtype
        self.mla_form = mla_form
        self.kda_mode = kda_mode
        self.kda_chunk = kda_chunk
        self.topk_override = topk_override
        # DSpark taps (MODEL.md §5): when set, every forward leaves `last_taps` [T, n·D], the AttnRes partial
        # sum P after each listed layer (pre-norm), concatenated in list order.
        self.tap_layers: list | None = None
        self.last_taps = None
        for L in range(self.cfg.num_hidden_layers):
            if not (self.cfg.is_kda(L) or self.cfg.is_mla(L)):
                raise ValueError(f"layer {L} is neither KDA nor MLA")

    # ---- state -----------------------------------------------------------------------------------------
    def new_state(self) -> dict:
        cfg = self.cfg
        layers = []
        for L in range(cfg.num_hidden_layers):
            layers.append(kda.new_state(cfg, self.dtype) if cfg.is_kda(L) else mla.new_state(cfg, self.dtype))
        return {"pos": 0, "layers": layers}

    # ---- forward ---------------------------------------------------------------------------------------
    def prefill(self, tokens, state: dict, capture: dict | None = None, embed_override=None) -> torch.Tensor:
        """Run the T new tokens `tokens` (continuing `state`), return logits [T, V] float32.

        embed_override (optional): (rows, values), rows = positions within this call, values [n, D] BF16-exact;
        those rows of the embedding are replaced (§3.1: image positions receive the projector's rows, §6)."""
        tokens = torch.as_tensor(list(tokens), dtype=torch.int64)
        if tokens.numel() == 0:
            return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size:
            raise ValueError("token id out of range")
        return self._forward(tokens, state, capture, embed_override)

    def decode(self, token: int, state: dict, capture: dict | None = None) -> torch.Tensor:
        """One token; returns logits [V] float32."""
        return self.prefill([int(token)], state, capture)[0]

    def _attn(self, L, x, st, cap):
        cfg = self.cfg
        if cfg.is_kda(L):
            mode = self.kda_mode or ("recurrent" if x.shape[0] == 1 else "chunked")
            return kda.kda_layer(self.ck, cfg, L, x, st, mode=mode, chunk=self.kda_chunk)
        return mla.mla_layer(self.ck, cfg, L, x, st, form=self.mla_form, topk_override=self.topk_override,
                             capture=cap)

    def _mlp(self, L, x, cap):
        if self.cfg.is_moe(L):
            return moe_layer(self.ck, self.cfg, L, x, capture=cap)
        return dense_layer(self.ck, self.cfg, L, x)

    def _forward(self, tokens, state, capture, embed_override=None):
        cfg, ck = self.cfg, self.ck
        eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
        # §3.1 embedding: B = [], P = e
        P = ck.get("model.embed_tokens.weight")[tokens]
        if embed_override is not None:
            rows, values = embed_override
            P = P.clone()
            P[torch.as_tensor(list(rows), dtype=torch.int64)] = torch.as_tensor(values, dtype=P.dtype)
        B: list = []
        taps: dict = {}
        for L in range(cfg.num_hidden_layers):
            pre = f"model.layers.{L}."
            cap: dict = {}
            # §3.2.1  x_attn_in = Mix([B_0..B_{n-1}, P])
            x_attn_in = mix(B + [P], ck.get(pre + "self_attention_res_norm.weight"),
                            ck.get(pre + "self_attention_res_proj.weight"), eps)
            # §3.2.2  block write
            write = (L % bs == 0)
            if write:
                B.append(P)
                P = None
            # §3.2.3  attention on the normed Mix result
            a = self._attn(L, rmsnorm(x_attn_in, ck.get(pre + "input_layernorm.weight"), eps),
                           state["layers"][L], cap)
            # §3.2.4
            P = a if write else bf16(P + a)
            # §3.2.5  x_mlp_in = Mix([B..., P]) (B includes this layer's write)
            x_mlp_in = mix(B + [P], ck.get(pre + "mlp_res_norm.weight"), ck.get(pre + "mlp_res_proj.weight"), eps)
            # §3.2.6
            m = self._mlp(L, rmsnorm(x_mlp_in, ck.get(pre + "post_attention_layernorm.weight"), eps), cap)
            P = bf16(P + m)
            if self.tap_layers and L in self.tap_layers:
                taps[L] = P
            if capture is not None:
                capture[f"L{L}.attn_in"] = x_attn_in
                capture[f"L{L}.attn_out"] = a
                capture[f"L{L}.mlp_in"] = x_mlp_in
                capture[f"L{L}.mlp_out"] = m
                for k, v in cap.items():
                    capture[f"L{L}.{k}"] = v
        # §3.2 final Mix over stored blocks + P, §3.8 final norm + lm_head (wide logits)
        h = mix(B + [P], ck.get("model.output_attn_res_norm.weight"),
                ck.get("model.output_attn_res_proj.weight"), eps)
        logits = lin_nr(rmsnorm(h, ck.get("model.norm.weight"), eps), ck.get("lm_head.weight")).to(torch.float32)
        if capture is not None:
            capture["final_hidden"] = h
            capture["logits"] = logits
        if self.tap_layers:
            self.last_taps = torch.cat([taps[L] for L in self.tap_layers], dim=-1)
        state["pos"] += tokens.numel()
        return logits

    # ---- batches ---------------------------------------------------------------------------------------
    def prefill_batch(self, requests: list, states: list | None = None, capture: dict | None = None):
        """Several requests of different lengths, flattened in request order (the reference loops).
        Returns logits [ΣT, V]; `capture` gets the concatenation of the per-request captures."""
        states = states if states is not None else [self.new_state() for _ in requests]
        outs, caps = [], []
        for toks, st in zip(requests, states):
            c = {} if capture is not None else None
            outs.append(self.prefill(toks, st, c))
            caps.append(c)
        if capture is not None:
            for k in caps[0]:
                capture[k] = torch.cat([c[k] for c in caps], dim=0)
        return torch.cat(outs, dim=0)

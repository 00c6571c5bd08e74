"""The K3.1 text model for training (MODEL.md §3), batched, on the GPU, with the numerics of the reference.

One definition with the reference: the elementwise math is `k3ref`'s own functions (AttnRes `mix` §3.2,
`rmsnorm`/`rmsnorm_nr`/`layernorm`/`situ_glu`/`bf16` §3, KDA `l2norm` §3.3.3), and every linear map follows
§3 "Lin": BF16 inputs and weights, FP32 accumulation (cuBLAS), output rounded to BF16.  Activations between
layers are FP32 tensors holding BF16 values exactly where §3 rounds, so an exported checkpoint run by
`k3ref.Model` gives the same logits up to accumulation order (tests/py/test_k3train.py states the bound).
What is new here is only what the reference does per request and too slowly for training: a batched chunked
delta rule (kda_batched.py), SDPA attention, all-expert MoE evaluation (E is small), and QAT.

Parameters are FP32 master weights named exactly like the released tensors without the `language_model.`
prefix (state_dict keys = checkpoint names), except the routed experts, stacked per layer as
`block_sparse_moe.experts.w{1,2,3}` [E, out, in] (export.py splits them into MXFP4 `experts.E.wN`).  Every
BF16 tensor of the release is rounded to BF16 on use (differentiable cast), the FP32 ones (conv, A_log,
dt_bias, o_norm, router bias) are used as they are, and expert weights go through the MXFP4 fake quantiser
with a straight-through gradient (qat.py).

Attention modes: "dense" (causal MLA; the DSA indexer still runs and, when the caller passes `kl_out`, is
trained to match the heads-averaged attention distribution, V3.2's warm-up) and "sparse" (each query attends to the indexer's
top-k keys, `index_topk`; the KL target is restricted to that set).  The indexer's inputs are detached, so
it learns only from the KL loss and the rest of the model only from the LM loss (V3.2).

`state` (optional) carries KDA recurrent/conv state and the MLA key/value/index-key caches across calls, so
long prompts are prefilled in pieces and decoding is incremental.

Long training rows (train/README.md, `--q-chunk`, `--recompute`): `q_chunk` runs the MLA layers' indexer,
selection, attention and KL per chunk of query rows under checkpoints (nothing [B, T, S] outlives a chunk);
`recompute` checkpoints the KDA and MLP sublayers. Neither changes the math: everything chunked is row-wise.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(_HERE, "..", "..", "reference"), os.path.join(_HERE, "..")):
    if os.path.isdir(os.path.join(_p, "k3ref")) and _p not in sys.path:
        sys.path.insert(0, _p)

from k3ref.attnres import mix  # noqa: E402
from k3ref.config import parse_config  # noqa: E402
from k3ref.kda import l2norm  # noqa: E402
from k3ref.numerics import bf16, layernorm, rmsnorm, rmsnorm_nr, situ_glu, topk_lower_index  # noqa: E402

from .kda_batched import delta_rule_chunked_batched  # noqa: E402
from .qat import ste  # noqa: E402


def topk_mask_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The mask of k3ref's topk_lower_index(scores, k) along the last dim (the k largest, exact ties to the lower
    index, §0.8) without sorting the row: the k-th largest value by torch.topk, everything above it, then the
    lowest-index ties at it. O(S) a row instead of a sort of S (the indexer's rows reach 64K keys)."""
    thr = torch.topk(scores, k, dim=-1).values[..., -1:]
    above = scores > thr
    tie = scores == thr
    need = k - above.sum(-1, keepdim=True)
    return above | (tie & (torch.cumsum(tie, dim=-1) <= need))


FP32_TENSORS = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def b16(w: torch.Tensor) -> torch.Tensor:
    """A BF16 checkpoint tensor as used in the forward: rounded to BF16 (gradient passes straight through)."""
    return w.to(torch.bfloat16)


def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """§3 Lin: BF16 x BF16 -> FP32 accumulate -> BF16 output (returned as FP32 holding BF16 values).
    On the CPU (tests, local evaluation) the same product is an FP32 GEMM of the BF16-rounded operands: CPU
    BF16 GEMMs are slow."""
    if x.device.type == "cpu":
        return F.linear(x.to(torch.bfloat16).float(), b16(w).float()).to(torch.bfloat16).float()
    return F.linear(x.to(torch.bfloat16), b16(w)).float()


def param_shapes(tc: dict) -> dict:
    """name -> (shape, init kind) for every trainable tensor of a text_config (trainer layout)."""
    cfg = parse_config({"text_config": tc})
    D, V = cfg.hidden_size, cfg.vocab_size
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
    Hm, Q, C = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    N, R, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    E, Lt, I = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    Is = I * cfg.num_shared_experts
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    s = {"model.embed_tokens.weight": ((V, D), "embed"), "lm_head.weight": ((V, D), "head"),
         "model.norm.weight": ((D,), "one"), "model.output_attn_res_norm.weight": ((D,), "one"),
         "model.output_attn_res_proj.weight": ((1, D), "zero")}
    nL = cfg.num_hidden_layers
    out_gain = 1.0 / math.sqrt(2 * nL)
    for L in range(nL):
        P = f"model.layers.{L}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            s[P + n + ".weight"] = ((D,), "one")
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            s[P + n + ".weight"] = ((1, D), "zero")
        A = P + "self_attn."
        if cfg.is_kda(L):
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                s[A + n + ".weight"] = ((H * K, D), "lin")
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                s[A + n + ".weight"] = ((H * K, 1, W), "conv")
            s[A + "f_a_proj.weight"] = ((K, D), "lin")
            s[A + "f_b_proj.weight"] = ((H * K, K), "lin")
            s[A + "b_proj.weight"] = ((H, D), "lin")
            s[A + "A_log"] = ((math.ceil(H / 128) * 128,), "alog")
            s[A + "dt_bias"] = ((H * K,), "dt")
            s[A + "o_norm.weight"] = ((K,), "one")
            s[A + "o_proj.weight"] = ((D, H * K), ("lin", out_gain))
        else:
            s[A + "q_a_proj.weight"] = ((Q, D), "lin")
            s[A + "q_a_layernorm.weight"] = ((Q,), "one")
            s[A + "q_b_proj.weight"] = ((Hm * (N + R), Q), "lin")
            s[A + "kv_a_proj_with_mqa.weight"] = ((C + R, D), "lin")
            s[A + "kv_a_layernorm.weight"] = ((C,), "one")
            s[A + "kv_b_proj.weight"] = ((Hm * (N + Dv), C), "lin")
            s[A + "g_proj.weight"] = ((Hm * Dv, D), "lin")
            s[A + "o_proj.weight"] = ((D, Hm * Dv), ("lin", out_gain))
            if cfg.index_topk > 0:
                J = A + "indexer."
                s[J + "wq_b.weight"] = ((Hi * Di, Q), "lin")
                s[J + "wk.weight"] = ((Di, D), "lin")
                s[J + "k_norm.weight"] = ((Di,), "one")
                s[J + "k_norm.bias"] = ((Di,), "zero")
                s[J + "weights_proj.weight"] = ((Hi, D), "lin")
        if L < cfg.first_k_dense_replace:
            M = P + "mlp."
            F_ = cfg.intermediate_size
            s[M + "gate_proj.weight"] = ((F_, D), "lin")
            s[M + "up_proj.weight"] = ((F_, D), "lin")
            s[M + "down_proj.weight"] = ((D, F_), ("lin", out_gain))
        else:
            M = P + "block_sparse_moe."
            s[M + "gate.weight"] = ((E, D), "lin")
            s[M + "routed_expert_down_proj.weight"] = ((Lt, D), "lin")
            s[M + "routed_expert_norm.weight"] = ((Lt,), "one")
            s[M + "routed_expert_up_proj.weight"] = ((D, Lt), ("lin", out_gain))
            s[M + "experts.w1"] = ((E, I, Lt), "lin")
            s[M + "experts.w3"] = ((E, I, Lt), "lin")
            s[M + "experts.w2"] = ((E, Lt, I), "lin")
            s[M + "shared_experts.gate_proj.weight"] = ((Is, D), "lin")
            s[M + "shared_experts.up_proj.weight"] = ((Is, D), "lin")
            s[M + "shared_experts.down_proj.weight"] = ((D, Is), ("lin", out_gain))
    return s


def _init(shape, kind, g):
    gain = 1.0
    if isinstance(kind, tuple):
        kind, gain = kind
    if kind == "one":
        return torch.ones(shape)
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "embed":
        return torch.randn(shape, generator=g)
    if kind == "head":
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if kind == "lin":
        return torch.randn(shape, generator=g) * gain / math.sqrt(shape[-1])
    if kind == "conv":
        w = torch.randn(shape, generator=g) * 0.1
        w[..., -1] += 1.0  # start near the identity (current token)
        return w
    if kind == "alog":
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))   # padding zeroed by K3Model
    if kind == "dt":
        return -1.0 - 5.0 * torch.rand(shape, generator=g)
    raise ValueError(kind)


class K3Model(nn.Module):
    def __init__(self, tc: dict, seed: int = 0):
        super().__init__()
        self.tc = tc
        self.cfg = parse_config({"text_config": tc})
        g = torch.Generator().manual_seed(seed)
        self.names = []
        self._qcache = None
        self.kl_dense = False   # see mla(): the indexer's KL target in the sparse mode
        self.q_chunk = 0        # MLA query rows per checkpointed chunk (0: all at once; see mla())
        self.recompute = False  # recompute the KDA and MLP sublayers in the backward pass (hidden(); long rows)
        self.kda_memory = 0     # > 0: kda() also returns the memory-cap hinge (--kda-memory; train/README.md)
        self.u_stats = None     # dict: kda() stores each layer's gate logits exp(A_log)·z there (calibration)
        self.params = nn.ParameterDict()
        for name, (shape, kind) in param_shapes(tc).items():
            self.params[name.replace(".", "__")] = nn.Parameter(_init(shape, kind, g))
            self.names.append(name)
        with torch.no_grad():
            for name in self.names:
                if name.endswith("A_log"):
                    self.p(name)[self.cfg.kda_num_heads:] = 0.0   # stored padded, padding is zero (§2)
        for L in range(self.cfg.num_hidden_layers):
            if self.cfg.is_moe(L):
                self.register_buffer(f"bias_{L}", torch.zeros(self.cfg.num_experts))

    # ---- parameter access ------------------------------------------------------------------------------
    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def w(self, name: str) -> torch.Tensor:
        """A BF16 tensor of the release, as FP32 holding BF16 values (norm weights, mix weights)."""
        return b16(self.p(name)).float()

    def named_master(self):
        for name in self.names:
            yield name, self.p(name)

    def qw(self, name):
        """Expert weight as used in the forward: MXFP4 values (BF16), straight-through gradient to the master."""
        if self._qcache is not None:
            if name not in self._qcache:
                self._qcache[name] = ste(self.p(name)).to(torch.bfloat16).detach()
            return self._qcache[name]
        return ste(self.p(name)).to(torch.bfloat16)

    def freeze_quant(self):
        """Evaluation: quantise the experts once instead of on every call."""
        self._qcache = {}

    def thaw_quant(self):
        self._qcache = None

    def router_bias(self, L):
        return getattr(self, f"bias_{L}")

    # ---- layers ----------------------------------------------------------------------------------------
    def kda(self, L, x, st, valid=None, forget=None):
        """§3.3 for one KDA layer. forget (optional) [B, T] bool, training only: True tokens decay every channel
        at the gate's floor (gate_lower_bound per token: e^-20 of the state is left after a 4-token window), so
        what the state held before the window is gone (the long-context stage's --kda-forget).
        With self.kda_memory = N > 0 (training's --kda-memory) it returns (output, hinge): hinge is the mean over
        tokens and channels of relu(log(1/N) − log(−g)), zero when every token decays each channel by at least
        1/N — a state that forgets within ~N tokens, so what it holds at the end of a training row is what it
        holds at 1M tokens (the math is the spec's; only the weights learn to keep the gate there)."""
        cfg = self.cfg
        A = f"model.layers.{L}.self_attn."
        B, T, _ = x.shape
        H, Dk = cfg.kda_num_heads, cfg.kda_head_dim
        outs = []
        for n in ("q", "k", "v"):
            pre = lin(x, self.p(A + f"{n}_proj.weight"))                   # [B, T, H·K] BF16 values
            if valid is not None:
                pre = torch.where(valid.unsqueeze(-1), pre, torch.zeros_like(pre))   # padding = zero history
            w = self.p(A + f"{n}_conv1d.weight")                            # FP32 [C, 1, W]
            W = w.shape[-1]
            hist = st[f"conv_{n}"] if st is not None else pre.new_zeros(B, W - 1, pre.shape[-1])
            full = torch.cat([hist, pre], dim=1)                            # [B, W-1+T, C]
            y = F.conv1d(full.transpose(1, 2), w, groups=w.shape[0]).transpose(1, 2)
            outs.append(bf16(F.silu(y)))                                    # §3.3.2
            if st is not None:
                st[f"conv_{n}"] = full[:, -(W - 1):].detach()
        q = l2norm(outs[0].view(B, T, H, Dk)) * Dk ** -0.5                 # §3.3.3
        k = l2norm(outs[1].view(B, T, H, Dk))
        v = outs[2].view(B, T, H, Dk)
        z = lin(lin(x, self.p(A + "f_a_proj.weight")), self.p(A + "f_b_proj.weight"))
        z = (z + self.p(A + "dt_bias")).view(B, T, H, Dk)                  # §3.3.4
        a = torch.exp(self.p(A + "A_log")[:H]).view(1, 1, H, 1)
        u = a * z                                                           # gate logits [B, T, H, Dk]
        g = cfg.gate_lower_bound * torch.sigmoid(u)
        hinge = None
        if self.u_stats is not None:
            self.u_stats[L] = (u[valid] if valid is not None else u.flatten(0, 1)).detach()   # [tokens, H, Dk]
        if self.kda_memory > 0:   # log(−g) = log(−lower_bound) + log σ(u), in FP32 without the sigmoid's underflow
            over = torch.relu(math.log(1.0 / self.kda_memory) - math.log(-cfg.gate_lower_bound) - F.logsigmoid(u))
            keep = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
            if forget is not None:
                keep = keep & ~forget
            hinge = (over * keep[..., None, None]).sum() / (keep.sum().clamp_min(1) * H * Dk)
        if forget is not None:
            g = torch.where(forget[..., None, None], torch.full_like(g, cfg.gate_lower_bound), g)
        beta = torch.sigmoid(lin(x, self.p(A + "b_proj.weight")))          # §3.3.5
        if valid is not None:   # padding tokens neither decay nor write the state
            g = torch.where(valid[..., None, None], g, torch.zeros_like(g))
            beta = torch.where(valid[..., None], beta, torch.zeros_like(beta))
        S0 = st["S"] if st is not None else None
        o, S = delta_rule_chunked_batched(q, k, v, g, beta, S0)           # §3.3.6
        if st is not None:
            st["S"] = S.detach()
        gate = torch.sigmoid(lin(x, self.p(A + "g_proj.weight"))).view(B, T, H, Dk)
        oh = bf16(rmsnorm_nr(o, self.p(A + "o_norm.weight"), cfg.rms_norm_eps) * gate)   # §3.3.7
        out = lin(oh.reshape(B, T, H * Dk), self.p(A + "o_proj.weight"))
        return (out, hinge) if hinge is not None else out

    def indexer_queries(self, L, x, c_q):
        """§3.5 steps 1 and 3 for T rows: q_I [B, T, Hi, Di] and the head weights w [B, T, Hi] (FP32, unrounded)."""
        cfg = self.cfg
        J = f"model.layers.{L}.self_attn.indexer."
        B, T, _ = x.shape
        qI = lin(c_q, self.p(J + "wq_b.weight")).view(B, T, cfg.index_n_heads, cfg.index_head_dim)   # §3.5.1
        wts = x @ self.w(J + "weights_proj.weight").t()                                               # §3.5.3
        return qI, wts

    def indexer_scores(self, qI, wts, kI_all, q_lo, S_len):
        """I [B, T, S] for the queries (qI, wts of indexer_queries) at positions q_lo.. over keys 0..S_len-1
        (−inf where not causal)."""
        B, T, Hi, Di = qI.shape
        dots = torch.relu(torch.einsum("bthd,bsd->bths", qI, kI_all))
        I = torch.einsum("bth,bths->bts", wts * (Hi ** -0.5 * Di ** -0.5), dots)
        pos = torch.arange(q_lo, q_lo + T, device=qI.device)
        causal = torch.arange(S_len, device=qI.device).unsqueeze(0) <= pos.unsqueeze(1)
        return I.masked_fill(~causal, float("-inf")), causal

    def mla(self, L, x, st, mode, kl_out, valid=None):
        cfg = self.cfg
        A = f"model.layers.{L}.self_attn."
        B, T, _ = x.shape
        Hm, N, R, Dv, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.v_head_dim, cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        c_q = rmsnorm(lin(x, self.p(A + "q_a_proj.weight")), self.w(A + "q_a_layernorm.weight"), eps)
        q = lin(c_q, self.p(A + "q_b_proj.weight")).view(B, T, Hm, N + R)
        ckv = lin(x, self.p(A + "kv_a_proj_with_mqa.weight"))
        c_hat = rmsnorm(ckv[..., :C], self.w(A + "kv_a_layernorm.weight"), eps)
        k_pe = ckv[..., C:]
        kv = lin(c_hat, self.p(A + "kv_b_proj.weight")).view(B, T, Hm, N + Dv)
        k = torch.cat([kv[..., :N], k_pe.unsqueeze(2).expand(B, T, Hm, R)], dim=-1)
        v = kv[..., N:]
        has_idx = cfg.index_topk > 0
        if has_idx:
            J = A + "indexer."
            kI = layernorm(lin(x.detach(), self.p(J + "wk.weight")), self.w(J + "k_norm.weight"),
                           self.w(J + "k_norm.bias"), cfg.index_k_norm_eps)
        q_lo = 0
        kvalid = valid
        if st is not None:
            q_lo = st["k"].shape[1] if "k" in st else 0
            if kvalid is None and (q_lo or "kvalid" in st):
                kvalid = torch.ones(B, T, dtype=torch.bool, device=x.device)
            if q_lo:
                k = torch.cat([st["k"], k], dim=1)
                v = torch.cat([st["v"], v], dim=1)
                if has_idx:
                    kI = torch.cat([st["kI"], kI], dim=1)
                if "kvalid" in st:
                    kvalid = torch.cat([st["kvalid"], kvalid], dim=1)
                else:
                    kvalid = None
            st["k"], st["v"] = k.detach(), v.detach()
            if has_idx:
                st["kI"] = kI.detach()
            if kvalid is not None:
                st["kvalid"] = kvalid
        adt = torch.float32 if x.device.type == "cpu" else torch.bfloat16
        qb, kb, vb = (t.transpose(1, 2).to(adt) for t in (q, k, v))      # [B, Hm, *, d] (BF16 values)
        want_kl = kl_out is not None and has_idx
        # the indexer's queries and head weights (inputs detached: it learns from the KL alone), O(T) tensors made
        # once for every chunk below
        qI, wts = self.indexer_queries(L, x.detach(), c_q.detach()) if has_idx else (None, None)
        kIa = kI if has_idx else None

        def attend(t0, t1, qb_c, kb, vb, kI, qI_c, wts_c):
            return self._attend(qb_c, kb, vb, kI, qI_c, wts_c, kvalid, q_lo + t0, t1 - t0, mode, want_kl)

        chunk = self.q_chunk if self.q_chunk > 0 else T
        if chunk >= T:
            o, kl_sum = attend(0, T, qb, kb, vb, kIa, qI, wts)
        else:
            # Query rows in chunks, each recomputed in the backward pass (checkpoint): every tensor of the
            # indexer, the selection and the KL is [B, chunk, S] instead of [B, T, S], and every one of them
            # is row-wise, so the result is the unchunked one (up to the KL mean's summation order).
            os_, kls = [], []
            for t0 in range(0, T, chunk):
                t1 = min(T, t0 + chunk)
                oc, klc = torch.utils.checkpoint.checkpoint(
                    attend, t0, t1, qb[:, :, t0:t1], kb, vb, kIa, qI[:, t0:t1] if has_idx else None,
                    wts[:, t0:t1] if has_idx else None, use_reentrant=False)
                os_.append(oc)
                kls.append(klc)
            o = torch.cat(os_, dim=2)
            kl_sum = torch.stack(kls).sum() if want_kl else None
        if want_kl:
            kl_out.append(kl_sum / (B * T))
        o = o.transpose(1, 2).float().reshape(B, T, Hm * Dv)
        if cfg.mla_use_output_gate:
            o = bf16(o * torch.sigmoid(lin(x, self.p(A + "g_proj.weight"))))
        return lin(o, self.p(A + "o_proj.weight"))

    def _attend(self, qb, kb, vb, kI, qI, wts, kvalid, q_lo, T, mode, want_kl):
        """§3.5 steps 4–6 and §3.4 steps 3–4 for the T query rows at positions q_lo.. (qb [B, Hm, T, d]; the
        indexer's qI, wts of indexer_queries) over the S keys of kb / vb / kI: the indexer's selection (sparse
        mode), the attention, and (want_kl) the indexer's KL loss summed over the rows.
        Returns o [B, Hm, T, Dv] and the KL sum (None without want_kl)."""
        cfg = self.cfg
        B, S = qb.shape[0], kb.shape[2]
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        has_idx = cfg.index_topk > 0
        # padding keys are never attended; a padding query attends to itself only (no empty softmax row)
        pad_mask = None
        if kvalid is not None:
            pos = torch.arange(q_lo, q_lo + T, device=qb.device)
            own = torch.arange(S, device=qb.device).unsqueeze(0) == pos.unsqueeze(1)         # [T, S]
            pad_mask = kvalid.unsqueeze(1) | own.unsqueeze(0)                                 # [B, T, S]
        sel = None
        if has_idx and (mode == "sparse" or want_kl):
            I, causal = self.indexer_scores(qI, wts, kI, q_lo, S)
            if pad_mask is not None:
                causal = causal & pad_mask
                I = I.masked_fill(~causal, float("-inf"))
            if mode == "sparse" and S > cfg.index_topk:
                sel = topk_mask_lower_index(I.detach(), cfg.index_topk) & causal   # §3.5.6, ties -> lower key
        if sel is None and pad_mask is not None:
            pos = torch.arange(q_lo, q_lo + T, device=qb.device)
            m = (torch.arange(S, device=qb.device).unsqueeze(0) <= pos.unsqueeze(1)) & pad_mask
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m.unsqueeze(1), scale=scale)
        elif sel is None:
            if q_lo == 0 and T == S:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
            else:
                pos = torch.arange(q_lo, q_lo + T, device=qb.device)
                m = torch.arange(S, device=qb.device).unsqueeze(0) <= pos.unsqueeze(1)
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=sel.unsqueeze(1), scale=scale)
        kl_sum = None
        if want_kl:
            with torch.no_grad():
                # kl_dense: the target is the attention over every causal key even when the LM path attends
                # sparsely, so an indexer that misses a key the heads would attend to can still learn to rank it
                # in (over the selected set alone a missed key never appears in the loss)
                mask = sel if sel is not None and not self.kl_dense else causal.expand(B, T, S)
                s = torch.einsum("bhtd,bhsd->bhts", qb.float(), kb.float()) * scale
                s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
                p = torch.softmax(s, dim=-1).mean(1)                                  # heads-averaged
            logq = torch.log_softmax(I.masked_fill(~mask, float("-inf")), dim=-1)
            kl_sum = (p * (torch.log(p.clamp_min(1e-30)) - logq.masked_fill(~mask, 0.0))).sum()
        return o, kl_sum

    def glu(self, x, pre):
        cfg = self.cfg
        a = situ_glu(lin(x, self.p(pre + "gate_proj.weight")), lin(x, self.p(pre + "up_proj.weight")),
                     cfg.situ_beta, cfg.situ_linear_beta)
        return lin(a, self.p(pre + "down_proj.weight"))

    def moe(self, L, x, load_out):
        cfg = self.cfg
        M = f"model.layers.{L}.block_sparse_moe."
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        s = torch.sigmoid(xf @ self.w(M + "gate.weight").t())                # §3.6.1 (FP32)
        K = cfg.num_experts_per_token
        ids = topk_lower_index(s.detach() + self.router_bias(L), K)           # ties -> lower id (§0.8)
        wsel = torch.gather(s, 1, ids)
        if cfg.moe_renormalize:
            wsel = wsel / (wsel.sum(-1, keepdim=True) + 1e-20)
        wsel = wsel * cfg.routed_scaling_factor
        if load_out is not None:
            load_out[L] = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
        z = lin(xf, self.p(M + "routed_expert_down_proj.weight")).to(torch.bfloat16)   # [n, Lt]
        w1 = self.qw(M + "experts.w1")                                      # [E, I, Lt] MXFP4 values
        w3 = self.qw(M + "experts.w3")
        w2 = self.qw(M + "experts.w2")                                      # [E, Lt, I]
        cd = torch.float32 if x.device.type == "cpu" else torch.bfloat16   # CPU: FP32 GEMM, same operands
        z, w1, w3, w2 = z.to(cd), w1.to(cd), w3.to(cd), w2.to(cd)
        gz = torch.einsum("nl,eil->eni", z, w1).to(torch.bfloat16).float()
        uz = torch.einsum("nl,eil->eni", z, w3).to(torch.bfloat16).float()
        a = situ_glu(gz, uz, cfg.situ_beta, cfg.situ_linear_beta).to(cd)
        y = torch.einsum("eni,eli->enl", a, w2).to(torch.bfloat16).float()  # [E, n, Lt] BF16 values
        wmat = torch.zeros(B * T, cfg.num_experts, device=x.device, dtype=torch.float32)
        wmat = wmat.scatter(1, ids, wsel)
        u = bf16(torch.einsum("ne,enl->nl", wmat, y))                        # §3.6.4 late weighting
        if cfg.latent_moe_use_norm:
            u = rmsnorm(u, self.w(M + "routed_expert_norm.weight"), cfg.rms_norm_eps)
        routed = lin(u, self.p(M + "routed_expert_up_proj.weight"))
        if cfg.num_shared_experts > 0:
            sh = self.glu(xf, M + "shared_experts.")
            return bf16(routed + sh).view(B, T, D)
        return routed.view(B, T, D)

    # ---- whole model -----------------------------------------------------------------------------------
    def new_state(self):
        return {"layers": [{} if self.cfg.is_mla(L) else None for L in range(self.cfg.num_hidden_layers)],
                "kda": {}}

    def hidden(self, tokens, state=None, mode="dense", kl_out=None, load_out=None, capture=None, valid=None,
               taps=None, media=None, forget=None, mem_out=None):
        """tokens [B, T] -> final normed hidden [B, T, D] (FP32, BF16 values).
        valid (optional) [B, T] bool: False marks left padding, which leaves every state untouched and is
        never attended to, so a left-padded batch computes what each prompt computes alone.
        taps (optional) dict {layer: None}: filled with the AttnRes partial sum P [B, T, D] after each listed
        layer (the DSpark draft's input, MODEL.md §5 "Target taps"; k3ref.Model.tap_layers does the same).
        media (optional): (mask [B, T] bool, rows [n, D] BF16-valued) — the True positions (the <|media_pad|>
        tokens, row-major) take the image rows in order instead of their embeddings (§3.1, MODEL.md §6).
        forget (optional) [B, T] bool: training's KDA forget windows (kda()).
        mem_out (optional) list: with self.kda_memory > 0, each KDA layer's memory-cap hinge is appended."""
        cfg = self.cfg
        eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
        P = b16(self.p("model.embed_tokens.weight"))[tokens].float()        # §3.1
        if media is not None:
            mask, rows = media
            if int(mask.sum()) != rows.shape[0]:
                raise ValueError(f"{int(mask.sum())} media positions but {rows.shape[0]} image rows")
            P = P.masked_scatter(mask.unsqueeze(-1), rows.to(P.dtype))
        Bl = []
        for L in range(cfg.num_hidden_layers):
            pre = f"model.layers.{L}."
            x_attn_in = mix(Bl + [P], self.w(pre + "self_attention_res_norm.weight"),
                            self.w(pre + "self_attention_res_proj.weight"), eps)          # §3.2.1
            write = (L % bs == 0)
            if write:
                Bl.append(P)
            xn = rmsnorm(x_attn_in, self.w(pre + "input_layernorm.weight"), eps)
            if cfg.is_kda(L):
                st = None
                if state is not None:
                    st = state["kda"].get(L) or self._fresh_kda(state, L, xn)
                if self.recompute and st is None and torch.is_grad_enabled():
                    # recomputed in the backward pass: the chunked scan's O(T·C·Dk) intermediates are not kept
                    a = torch.utils.checkpoint.checkpoint(self.kda, L, xn, None, valid, forget, use_reentrant=False)
                else:
                    a = self.kda(L, xn, st, valid, forget)
                if isinstance(a, tuple):
                    a, hinge = a
                    if mem_out is not None:
                        mem_out.append(hinge)
            else:
                st = state["layers"][L] if state is not None else None
                a = self.mla(L, xn, st, mode, kl_out, valid)
            P = a if write else bf16(P + a)                                                   # §3.2.4
            x_mlp_in = mix(Bl + [P], self.w(pre + "mlp_res_norm.weight"), self.w(pre + "mlp_res_proj.weight"), eps)
            xm = rmsnorm(x_mlp_in, self.w(pre + "post_attention_layernorm.weight"), eps)
            if cfg.is_moe(L):
                mlp = lambda v, L=L: self.moe(L, v, load_out)  # noqa: E731
            else:
                mlp = lambda v, pre=pre: self.glu(v, pre + "mlp.")  # noqa: E731
            if self.recompute and torch.is_grad_enabled():
                # load_out[L] is assigned, not appended: the recompute writes the same counts again
                m = torch.utils.checkpoint.checkpoint(mlp, xm, use_reentrant=False)
            else:
                m = mlp(xm)
            P = bf16(P + m)
            if taps is not None and L in taps:
                taps[L] = P
            if capture is not None:
                capture[f"L{L}.attn_in"], capture[f"L{L}.attn_out"] = x_attn_in, a
                capture[f"L{L}.mlp_in"], capture[f"L{L}.mlp_out"] = x_mlp_in, m
        h = mix(Bl + [P], self.w("model.output_attn_res_norm.weight"),
                self.w("model.output_attn_res_proj.weight"), eps)
        return rmsnorm(h, self.w("model.norm.weight"), eps)

    def _fresh_kda(self, state, L, x):
        """A zero KDA state for layer L, stored in `state` (kda() updates it in place)."""
        cfg = self.cfg
        B = x.shape[0]
        H, Dk, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        st = state["kda"][L] = {}
        st["S"] = x.new_zeros(B, H, Dk, Dk)
        for n in ("q", "k", "v"):
            st[f"conv_{n}"] = x.new_zeros(B, W - 1, H * Dk)
        return st

    def logits(self, h):
        """§3.8: FP32 logits from BF16-valued inputs and weights."""
        return h @ self.w("lm_head.weight").t()

    def forward(self, tokens, state=None, mode="dense"):
        return self.logits(self.hidden(tokens, state, mode))

"""MoonViT-V2 vision tower and projector (MODEL.md §6), in numpy, FP64 compute with BF16 roundings.

Written from the spec, independent of the C++ engine; unlike the text reference it needs numpy only (no
torch), so it also runs where PyTorch is not installed. Rounding convention as the text reference
(k3ref/numerics.py, MODEL.md §3 "Conventions", §0.10): activations are FP64 and rounded to BF16 (a single
correct rounding from FP64) exactly where a BF16 model would hold a BF16 tensor:

    x0   = bf16(patches)                                   pixel values enter the BF16 Conv2d
    x    = Lin(W_patch)(x0)                                Conv2d 14×14 stride 14 = matmul over 3·14·14
    x    = bf16(x + pos)     pos = table, or bf16(bilinear(table)) when the grid differs from the table
    per block (pre-norm):
      h  = RMSNorm0(x);  q,k,v = Lin(wqkv)(h) → [3, heads, hd]
      q,k = bf16(RoPE2D(q)), bf16(RoPE2D(k))
      o  = bf16(softmax(q kᵀ · hd^−½) v)                   full attention within the image (varlen)
      x  = bf16(x + Lin(wo)(o))
      h  = RMSNorm1(x);  x = bf16(x + Lin(fc1)(bf16(gelu_tanh(Lin(fc0)(h)))))
    y    = RMSNorm_final(x)
    m    = merge 2×2 (TL, TR, BL, BR) → [h/2·w/2, 4·Dvt], merged grid row-major
    out  = RMSNorm_post(Lin(proj.2)(bf16(gelu_erf(Lin(proj.0)(m)))), eps = projector_ln_eps)

Interpretations (MODEL.md is silent or says [unk]; written down here and in docs/ARCHITECTURE.md):
- Vision RMSNorm eps: §0.2 — `vt_rms_norm_eps` from vision_config if present, else 1e-6 (§6's "torch
  default eps" is marked [unk]; §0 settles [unk]s). RMSNorm itself is §3's (normalise, round, × weight, round).
- Position-table resize: torch `F.interpolate(table[None].permute(0,3,1,2), size=(h, w), mode="bilinear",
  align_corners=False, antialias=False)` written out by hand (`bilinear_resize`); no resize when (h, w)
  equals the table's size. Result rounded to BF16 (the table is BF16).
- 2-D RoPE generalised to any head_dim hd (multiple of 4): hd/2 complex pairs of adjacent elements;
  f_i = 10000^(−4i/hd), i = 0..hd/4−1; pair 2i turns by col·f_i, pair 2i+1 by row·f_i (row, col = the
  patch's position in the image's grid). For hd = 128 this is §6 exactly.
- t = 1 (images): the temporal mean of the merge is the identity and no time embedding is added.
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# numerics


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest BF16 value (ties to even), returned as float64.

    A single correct rounding: a value that float32 rounding puts exactly on a BF16 midpoint without being
    that midpoint is nudged one float32 ulp towards the true value first (no double rounding)."""
    x = np.asarray(x, dtype=np.float64)
    f = x.astype(np.float32)
    bits = f.view(np.uint32)
    mid = ((bits & 0xFFFF) == 0x8000) & (f.astype(np.float64) != x) & np.isfinite(x)
    if mid.any():
        toward = np.where(x > f.astype(np.float64), np.float32(np.inf), np.float32(-np.inf))
        f = np.where(mid, np.nextafter(f, toward), f).astype(np.float32)
        bits = f.view(np.uint32)
    r = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    r = np.where(np.isnan(f), bits, r).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)


def lin(x, w):
    """§3 Lin: x Wᵀ, wide accumulation, output rounded to BF16."""
    return bf16(x @ w.T)


def rmsnorm(x, w, eps):
    """§3 RMSNorm: w ⊙ bf16(x · rsqrt(mean(x²) + ε)), the product rounded to BF16 as well."""
    n = bf16(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))
    return bf16(w * n)


def gelu_tanh(x):
    """`gelu_pytorch_tanh`: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    """Exact GELU: 0.5 x (1 + erf(x / √2))."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


# ---------------------------------------------------------------------------------------------------------
# checkpoint (plain safetensors parsing: numpy has no bfloat16)

_DT = {"BF16": (np.uint16, 2), "F32": (np.float32, 4), "F64": (np.float64, 8)}


def _read_safetensors(path: str, wanted: set) -> dict:
    out = {}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__" or name not in wanted:
                continue
            dt, size = _DT[meta["dtype"]]
            b0, b1 = meta["data_offsets"]
            f.seek(base + b0)
            a = np.frombuffer(f.read(b1 - b0), dtype=dt).reshape(meta["shape"])
            if meta["dtype"] == "BF16":
                a = (a.astype(np.uint32) << 16).view(np.float32)
            out[name] = a.astype(np.float64)
    return out


class VisionWeights:
    """The §2 vision/projector tensors of a checkpoint directory, FP64 (BF16 values exactly)."""

    def __init__(self, ckpt_dir: str):
        with open(os.path.join(ckpt_dir, "config.json")) as f:
            top = json.load(f)
        if "vision_config" not in top:
            raise ValueError(f"{ckpt_dir}: config.json has no vision_config (a --no-vision checkpoint)")
        vc = self.cfg = top["vision_config"]
        self.hidden = vc["vt_hidden_size"]
        self.heads = vc["vt_num_attention_heads"]
        self.qkv = vc.get("qkv_hidden_size", self.hidden)
        self.head_dim = self.qkv // self.heads
        self.layers = vc["vt_num_hidden_layers"]
        self.patch = vc["patch_size"]
        self.eps = float(vc.get("vt_rms_norm_eps", 1e-6))           # §0.2
        self.proj_eps = float(vc.get("projector_ln_eps", 1e-5))
        mk = vc.get("merge_kernel_size", [2, 2])
        if list(mk) != [2, 2]:
            raise ValueError(f"merge_kernel_size {mk}: only [2, 2] (sd2_tpool) is implemented")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} is not a multiple of 4 (2-D RoPE)")
        names = ["vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                 "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"]
        for b in range(self.layers):
            B = f"vision_tower.encoder.blocks.{b}."
            names += [B + s for s in ("norm0.weight", "norm1.weight", "wqkv.weight", "wo.weight",
                                      "mlp.fc0.weight", "mlp.fc1.weight")]
        index = os.path.join(ckpt_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            files = {}
            for n in names:
                files.setdefault(wmap[n], set()).add(n)
        else:
            files = {"model.safetensors": set(names)}
        t = {}
        for fn, ns in files.items():
            t.update(_read_safetensors(os.path.join(ckpt_dir, fn), ns))
        missing = [n for n in names if n not in t]
        if missing:
            raise ValueError(f"{ckpt_dir}: missing vision tensors {missing[:3]}...")
        self.t = t
        self.patch_w = t[names[0]].reshape(self.hidden, -1)     # [Dvt, 3·p·p], (c, y, x) inner order
        self.pos = t[names[1]]                                  # [H0, W0, Dvt]


# ---------------------------------------------------------------------------------------------------------
# §6 pieces


def bilinear_resize(table: np.ndarray, h: int, w: int) -> np.ndarray:
    """torch.nn.functional.interpolate(mode="bilinear", align_corners=False) of table [H0, W0, C] to
    [h, w, C]: source coordinate s = (o + 0.5)·(in/out) − 0.5 clamped at 0, neighbours ⌊s⌋ and
    min(⌊s⌋ + 1, in − 1), weights 1 − λ and λ (λ = s − ⌊s⌋); rows first then columns (separable)."""
    def axis(n_in, n_out):
        s = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
        s = np.maximum(s, 0.0)
        i0 = np.floor(s).astype(np.int64)
        i0 = np.minimum(i0, n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        lam = s - i0
        return i0, i1, lam

    H0, W0, _ = table.shape
    r0, r1, ly = axis(H0, h)
    c0, c1, lx = axis(W0, w)
    ly = ly[:, None, None]
    lx = lx[None, :, None]
    top = table[r0][:, c0] * (1 - lx) + table[r0][:, c1] * lx
    bot = table[r1][:, c0] * (1 - lx) + table[r1][:, c1] * lx
    return top * (1 - ly) + bot * ly


def rope_2d(x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """x [N, H, hd] → rotated, FP64. Adjacent pairs (x[2j], x[2j+1]) as complex numbers; pair 2i by
    col·f_i, pair 2i+1 by row·f_i, f_i = 10000^(−4i/hd)."""
    N, H, hd = x.shape
    i = np.arange(hd // 4, dtype=np.float64)
    f = 10000.0 ** (-4.0 * i / hd)                                  # [hd/4]
    ang = np.empty((N, hd // 2))
    ang[:, 0::2] = cols[:, None] * f[None, :]                       # even pairs: width index
    ang[:, 1::2] = rows[:, None] * f[None, :]                       # odd pairs: row index
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def merge_2x2(x: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """[gh·gw, C] row-major grid → [gh/2·gw/2, 4C]: each 2×2 group as TL, TR, BL, BR, merged grid row-major."""
    C = x.shape[-1]
    g = x.reshape(gh // 2, 2, gw // 2, 2, C).transpose(0, 2, 1, 3, 4)   # [h/2, w/2, kh, kw, C]
    return g.reshape((gh // 2) * (gw // 2), 4 * C)


def encode_image(vw: VisionWeights, patches: np.ndarray, gh: int, gw: int, capture: dict | None = None):
    """One image: patches f32 [gh·gw, 3·p·p] (grid row-major, (c, y, x) inside a patch) → BF16-exact
    FP64 rows [gh/2·gw/2, text_hidden] in merged-grid row-major order."""
    if gh <= 0 or gw <= 0 or gh % 2 or gw % 2:
        raise ValueError(f"grid {gh}x{gw} must be positive and even")
    t, D, H, hd = vw.t, vw.hidden, vw.heads, vw.head_dim
    N = gh * gw
    x0 = bf16(np.asarray(patches, dtype=np.float64).reshape(N, -1))
    # patch embedding + position table (resized when the grid differs)
    x = lin(x0, vw.patch_w)
    H0, W0 = vw.pos.shape[:2]
    pos = vw.pos if (gh, gw) == (H0, W0) else bf16(bilinear_resize(vw.pos, gh, gw))
    x = bf16(x + pos.reshape(N, D))
    if capture is not None:
        capture["embed"] = x
    rows = np.repeat(np.arange(gh, dtype=np.float64), gw)
    cols = np.tile(np.arange(gw, dtype=np.float64), gh)
    scale = hd ** -0.5
    for b in range(vw.layers):
        B = f"vision_tower.encoder.blocks.{b}."
        h = rmsnorm(x, t[B + "norm0.weight"], vw.eps)
        qkv = lin(h, t[B + "wqkv.weight"]).reshape(N, 3, H, hd)
        q = bf16(rope_2d(qkv[:, 0], rows, cols))
        k = bf16(rope_2d(qkv[:, 1], rows, cols))
        v = qkv[:, 2]
        o = np.empty((N, H, hd))
        for j in range(H):
            s = (q[:, j] @ k[:, j].T) * scale
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            o[:, j] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, j]
        o = bf16(o).reshape(N, H * hd)
        x = bf16(x + lin(o, t[B + "wo.weight"]))
        h = rmsnorm(x, t[B + "norm1.weight"], vw.eps)
        g = bf16(gelu_tanh(lin(h, t[B + "mlp.fc0.weight"])))
        x = bf16(x + lin(g, t[B + "mlp.fc1.weight"]))
        if capture is not None:
            capture[f"B{b}"] = x
    y = rmsnorm(x, t["vision_tower.encoder.final_layernorm.weight"], vw.eps)
    if capture is not None:
        capture["final"] = y
    m = merge_2x2(y, gh, gw)
    p = bf16(gelu_erf(lin(m, t["mm_projector.proj.0.weight"])))
    out = rmsnorm(lin(p, t["mm_projector.proj.2.weight"]), t["mm_projector.post_norm.weight"], vw.proj_eps)
    if capture is not None:
        capture["out"] = out
    return out


def encode(vw: VisionWeights, images: list) -> np.ndarray:
    """images: list of (patches, gh, gw); rows of all images concatenated in order (each image attends
    only to itself: varlen)."""
    return np.concatenate([encode_image(vw, p, gh, gw) for p, gh, gw in images], axis=0)

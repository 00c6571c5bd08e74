"""MoonViT-V2 tower + patchmergerv2 projector for training (MODEL.md §6), batched, in PyTorch, with the numerics of
reference/k3ref/vision.py (the numpy reference the engine is tested against).

Same rounding points as k3ref/vision.py's docstring: activations are FP32 tensors holding BF16 values where a
BF16 model holds BF16 tensors; every linear map is §3 "Lin" (model.lin: BF16 operands, FP32 accumulation, BF16
output); RMSNorm is k3ref.numerics.rmsnorm (normalise, round, × weight, round); attention is full (non-causal)
within each image, FP32 softmax, output rounded once; 2-D RoPE pairs adjacent elements, pair 2i turned by
col·f_i and pair 2i+1 by row·f_i, f_i = 10000^(−4i/hd); GELU tanh in the blocks, exact GELU in the projector.

A batch is images of one grid size (gh, gw) (the generator draws 112 × 112 → 8 × 8); the position table is
used as it is when the grid equals its size, else resized bilinearly (F.interpolate, align_corners=False) and
rounded to BF16, as k3ref does.  Parameters are named exactly like the released tensors (`vision_tower.…`,
`mm_projector.…`), so state_dict() is the checkpoint's vision part.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import bf16, lin, rmsnorm

# The tower of k3-tiny-vl: MoonViT-V2's structure (VISION_FULL in reference/make_checkpoint.py) scaled down.
VISION_TINY = {
    "vt_hidden_size": 256, "vt_num_attention_heads": 4, "qkv_hidden_size": 256, "vt_num_hidden_layers": 6,
    "vt_intermediate_size": 1024, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "vt_rms_norm_eps": 1e-6,
}


def vision_config(text_hidden: int, extra: dict | None = None) -> dict:
    """The vision_config of config.json: make_checkpoint's MoonViT-V2 keys with the sizes above."""
    import make_checkpoint  # reference/, on sys.path through export.py
    vc = dict(make_checkpoint.VISION_FULL)
    vc.update(VISION_TINY)
    vc.update(extra or {})
    vc["text_hidden_size"] = text_hidden
    return vc


def tensor_shapes(vc: dict) -> dict:
    """Released name -> shape of every vision/projector tensor (make_checkpoint.py's inventory)."""
    vt, p, qkv, vi = vc["vt_hidden_size"], vc["patch_size"], vc["qkv_hidden_size"], vc["vt_intermediate_size"]
    mk = 4 * vt
    T = "vision_tower."
    s = {T + "patch_embed.proj.weight": (vt, 3, p, p),
         T + "patch_embed.pos_emb.weight": (vc["init_pos_emb_height"], vc["init_pos_emb_width"], vt)}
    for b in range(vc["vt_num_hidden_layers"]):
        B = T + f"encoder.blocks.{b}."
        s.update({B + "norm0.weight": (vt,), B + "norm1.weight": (vt,), B + "wqkv.weight": (3 * qkv, vt),
                  B + "wo.weight": (vt, qkv), B + "mlp.fc0.weight": (vi, vt), B + "mlp.fc1.weight": (vt, vi)})
    s.update({T + "encoder.final_layernorm.weight": (vt,), "mm_projector.proj.0.weight": (mk, mk),
              "mm_projector.proj.2.weight": (vc["text_hidden_size"], mk),
              "mm_projector.post_norm.weight": (vc["text_hidden_size"],)})
    return s


def rope_2d(x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """x [B, N, H, hd] (N = gh·gw, grid row-major) -> rotated, FP32 (not rounded)."""
    hd = x.shape[-1]
    i = torch.arange(hd // 4, dtype=torch.float64, device=x.device)
    f = 10000.0 ** (-4.0 * i / hd)
    rows = torch.arange(gh, dtype=torch.float64, device=x.device).repeat_interleave(gw)
    cols = torch.arange(gw, dtype=torch.float64, device=x.device).repeat(gh)
    ang = torch.empty(gh * gw, hd // 2, dtype=torch.float64, device=x.device)
    ang[:, 0::2] = cols[:, None] * f[None, :]
    ang[:, 1::2] = rows[:, None] * f[None, :]
    c = torch.cos(ang).float()[None, :, None, :]
    s = torch.sin(ang).float()[None, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


class VisionTower(nn.Module):
    def __init__(self, vc: dict, seed: int = 0):
        super().__init__()
        self.vc = vc
        self.D, self.H = vc["vt_hidden_size"], vc["vt_num_attention_heads"]
        self.hd = vc["qkv_hidden_size"] // self.H
        self.layers = vc["vt_num_hidden_layers"]
        self.eps, self.proj_eps = float(vc.get("vt_rms_norm_eps", 1e-6)), float(vc.get("projector_ln_eps", 1e-5))
        self.patch = vc["patch_size"]
        g = torch.Generator().manual_seed(seed)
        self.names = []
        self.params = nn.ParameterDict()
        nb = self.layers
        for name, shape in tensor_shapes(vc).items():
            if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
                t = torch.ones(shape)
            elif name.endswith("pos_emb.weight"):
                t = torch.randn(shape, generator=g) * 0.02
            else:
                fan_in = math.prod(shape[1:])
                std = 1.0 / math.sqrt(fan_in)
                if name.endswith(("wo.weight", "mlp.fc1.weight")):
                    std /= math.sqrt(2 * nb)             # residual branches: GPT-2 style depth scaling
                t = torch.randn(shape, generator=g) * std
            self.params[name.replace(".", "__")] = nn.Parameter(t)
            self.names.append(name)

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def w(self, name):
        """A BF16 tensor as used in the forward (FP32 holding BF16 values; gradient straight through)."""
        return self.p(name).to(torch.bfloat16).float()

    def named_tensors(self):
        for n in self.names:
            yield n, self.p(n)

    def forward(self, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """patches f32 [B, gh·gw, 3·p·p] (grid row-major, (c, y, x) inside a patch) -> image rows
        [B, gh/2·gw/2, text_hidden] (FP32 holding BF16 values), merged grid row-major."""
        B, N, _ = patches.shape
        D, H, hd = self.D, self.H, self.hd
        T = "vision_tower."
        x0 = bf16(patches)
        x = lin(x0, self.p(T + "patch_embed.proj.weight").reshape(D, -1))
        pos = self.w(T + "patch_embed.pos_emb.weight")                                  # [H0, W0, D]
        if tuple(pos.shape[:2]) != (gh, gw):
            pos = bf16(F.interpolate(pos.permute(2, 0, 1)[None], size=(gh, gw), mode="bilinear",
                                     align_corners=False, antialias=False)[0].permute(1, 2, 0))
        x = bf16(x + pos.reshape(1, N, D))
        for b in range(self.layers):
            Bn = T + f"encoder.blocks.{b}."
            h = rmsnorm(x, self.w(Bn + "norm0.weight"), self.eps)
            qkv = lin(h, self.p(Bn + "wqkv.weight")).view(B, N, 3, H, hd)
            q = bf16(rope_2d(qkv[:, :, 0], gh, gw)).transpose(1, 2)                    # [B, H, N, hd]
            k = bf16(rope_2d(qkv[:, :, 1], gh, gw)).transpose(1, 2)
            v = qkv[:, :, 2].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5)             # FP32, full attention
            o = bf16(o.transpose(1, 2).reshape(B, N, H * hd))
            x = bf16(x + lin(o, self.p(Bn + "wo.weight")))
            h = rmsnorm(x, self.w(Bn + "norm1.weight"), self.eps)
            g = bf16(F.gelu(lin(h, self.p(Bn + "mlp.fc0.weight")), approximate="tanh"))
            x = bf16(x + lin(g, self.p(Bn + "mlp.fc1.weight")))
        y = rmsnorm(x, self.w(T + "encoder.final_layernorm.weight"), self.eps)
        m = y.view(B, gh // 2, 2, gw // 2, 2, D).permute(0, 1, 3, 2, 4, 5).reshape(B, (gh // 2) * (gw // 2), 4 * D)
        pr = bf16(F.gelu(lin(m, self.p("mm_projector.proj.0.weight"))))
        return rmsnorm(lin(pr, self.p("mm_projector.proj.2.weight")), self.w("mm_projector.post_norm.weight"),
                       self.proj_eps)


def patchify(img: torch.Tensor, patch: int = 14) -> torch.Tensor:
    """uint8 [B, H, W, 3] (H, W multiples of patch) -> f32 [B, (H/p)·(W/p), 3·p·p], (v/255 − 0.5)/0.5 in FP32 as
    the engine computes it (k3data.images.patches for a batch, on the device)."""
    B, Hh, Ww, _ = img.shape
    v = (img.float() / 255.0 - 0.5) / 0.5
    gh, gw = Hh // patch, Ww // patch
    v = v.view(B, gh, patch, gw, patch, 3).permute(0, 1, 3, 5, 2, 4)
    return v.reshape(B, gh * gw, 3 * patch * patch)

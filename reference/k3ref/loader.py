"""Checkpoint reader for the released layout (MODEL.md §1, §2, §4).

A checkpoint directory holds `config.json` (with `text_config`), `model.safetensors.index.json` (`weight_map`:
tensor name -> shard file) and the shards.  A single `model.safetensors` without an index is accepted too.
Floating tensors are converted to the compute dtype on first use (BF16/F32 -> FP64 is exact).  MXFP4 experts
stay packed (U8) and are dequantised by `expert()` when a token routes to them (§4, §0.6).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open

from . import mxfp4
from .config import TextConfig, load_config

TEXT = "language_model."


class Checkpoint:
    def __init__(self, ckpt_dir: str, dtype=torch.float64):
        self.dir = ckpt_dir
        self.dtype = dtype
        self.cfg: TextConfig = load_config(ckpt_dir)
        idx_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
        if os.path.exists(idx_path):
            with open(idx_path) as f:
                self.weight_map: dict = json.load(f)["weight_map"]
        else:
            single = os.path.join(ckpt_dir, "model.safetensors")
            with safe_open(single, framework="pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        self.shards = sorted(set(self.weight_map.values()))
        self._raw: dict[str, torch.Tensor] = {}
        for shard in self.shards:
            with safe_open(os.path.join(ckpt_dir, shard), framework="pt") as f:
                for k in f.keys():
                    if self.weight_map.get(k) == shard:
                        self._raw[k] = f.get_tensor(k)
        missing = [k for k in self.weight_map if k not in self._raw]
        if missing:
            raise KeyError(f"tensors listed in the index but absent from their shard: {missing[:5]} ...")
        self._conv: dict[str, torch.Tensor] = {}
        self._experts: dict[tuple, torch.Tensor] = {}
        self.used: set = set()  # full names of the tensors read so far (tests: every text tensor is used)

    # ---- plain tensors ---------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return (TEXT + name) in self._raw

    def get(self, name: str) -> torch.Tensor:
        """Tensor `language_model.<name>` in the compute dtype."""
        t = self._conv.get(name)
        if t is None:
            if TEXT + name not in self._raw:
                raise KeyError(f"checkpoint {self.dir} has no tensor {TEXT + name}")
            raw = self._raw[TEXT + name]
            self.used.add(TEXT + name)
            if not raw.is_floating_point():
                raise TypeError(f"{name} is {raw.dtype}, not floating")
            t = raw.to(self.dtype)
            self._conv[name] = t
        return t

    def get_opt(self, name: str):
        return self.get(name) if self.has(name) else None

    def raw_dtype(self, name: str) -> torch.dtype:
        return self._raw[TEXT + name].dtype

    def layer(self, L: int, name: str) -> torch.Tensor:
        return self.get(f"model.layers.{L}.{name}")

    def layer_opt(self, L: int, name: str):
        return self.get_opt(f"model.layers.{L}.{name}")

    # ---- MXFP4 experts (§4) ----------------------------------------------------------------------------
    def expert(self, L: int, e: int, w: str) -> torch.Tensor:
        """Logical weight of expert e, `w` in {"w1","w2","w3"}: dequantised MXFP4 (or plain, if the
        checkpoint stores that expert unquantised — §0.6 decides by the tensors present)."""
        key = (L, e, w)
        t = self._experts.get(key)
        if t is None:
            base = f"{TEXT}model.layers.{L}.block_sparse_moe.experts.{e}.{w}."
            if base + "weight_packed" in self._raw:
                self.used |= {base + "weight_packed", base + "weight_scale"}
                t = mxfp4.dequant(self._raw[base + "weight_packed"], self._raw[base + "weight_scale"], self.dtype)
            else:
                self.used.add(base + "weight")
                t = self._raw[base + "weight"].to(self.dtype)
            self._experts[key] = t
        return t

    def text_tensor_names(self) -> set:
        return {k for k in self._raw if k.startswith(TEXT)}

    # ---- fingerprint -----------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """sha256 of config.json, the index (if any) and every shard file."""
        files = ["config.json"]
        if os.path.exists(os.path.join(self.dir, "model.safetensors.index.json")):
            files.append("model.safetensors.index.json")
        files += self.shards
        out = {}
        for fn in files:
            h = hashlib.sha256()
            with open(os.path.join(self.dir, fn), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[fn] = h.hexdigest()
        return out

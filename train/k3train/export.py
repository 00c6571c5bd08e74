"""Configs of the trained models and export to the released checkpoint layout (MODEL.md §1, §2, §4, §7).

The export writes config.json (kimi_k3 layout, built by reference/make_checkpoint.py's own config builder so
the two generators cannot drift), safetensors shards of ≤ 15 MiB with an index (each shard fits the device
tool's 16 MiB file limit), and the tokenizer files of the 12,000-rank test vocabulary
(tests/data/tok_golden) with the 256 special slots named as make_checkpoint.py names them.
BF16 tensors are rounded from the FP32 master weights; FP32 ones (conv, A_log, dt_bias, o_norm, router
bias) stay FP32; routed experts are written as MXFP4 with k3ref's §0.9 quantiser — the same values the QAT
forward used (qat.fake_quant is tested bit-exact against it).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.abspath(os.path.join(_HERE, "..", ".."))
for _p in (os.path.join(_REPO, "reference"), os.path.join(_HERE, "..")):
    if os.path.isdir(_p) and _p not in sys.path:
        sys.path.insert(0, _p)

import make_checkpoint  # noqa: E402
from k3ref import mxfp4  # noqa: E402

from .model import FP32_TENSORS  # noqa: E402

LM = "language_model."
TOKENIZER_DIRS = [os.path.join(_REPO, "tests", "data", "tok_golden"), os.path.join(_HERE, "..", "tok_golden")]
SHARD_BYTES = 15 * 1024 * 1024

# k3-tiny: the embedded default model (Appendix A invariants kept: MLA at 1-indexed 4, 8; block size 3 with
# writes at layers 0, 3, 6 (layer 3 is MLA); latent = hidden/2; latent, moe_intermediate, d_I multiples of 32).
TINY = {
    "hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 12256,
    "linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 64,
    "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 48, "qk_rope_head_dim": 16, "v_head_dim": 64,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 256,
    "intermediate_size": 768, "num_experts": 16, "num_experts_per_token": 2,
    "routed_expert_hidden_size": 128, "moe_intermediate_size": 192, "num_shared_experts": 2,
    "attn_res_block_size": 3, "max_position_embeddings": 262144,
}
CONFIGS = {"tiny": TINY}


def build_config(name: str = "tiny", extra: dict | None = None) -> dict:
    over = dict(CONFIGS[name])
    over.update(extra or {})
    return make_checkpoint.build_config("nano", overrides=list(over.items()), vision=False)


def tokenizer_dir() -> str:
    for d in TOKENIZER_DIRS:
        if os.path.exists(os.path.join(d, "tiktoken.model")):
            return d
    raise FileNotFoundError("test vocabulary tests/data/tok_golden not found")


def write_tokenizer(out: str, vocab_size: int):
    src = tokenizer_dir()
    shutil.copyfile(os.path.join(src, "tiktoken.model"), os.path.join(out, "tiktoken.model"))
    with open(os.path.join(out, "tiktoken.model")) as f:
        n_base = sum(1 for line in f if line.strip())
    if n_base + make_checkpoint.NUM_SPECIALS != vocab_size:
        raise ValueError(f"vocabulary has {n_base} base ranks; vocab_size {vocab_size} needs "
                         f"{vocab_size - make_checkpoint.NUM_SPECIALS}")
    names = {n_base + i: make_checkpoint.SPECIAL_NAMES.get(i, "<|reserved_token_%d|>" % (n_base + i))
             for i in range(make_checkpoint.NUM_SPECIALS)}
    decoder = {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, n in names.items()}
    make_checkpoint.dump_json({
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
    }, os.path.join(out, "tokenizer_config.json"))


@torch.no_grad()
def checkpoint_tensors(model) -> dict:
    """Released tensor name -> tensor (CPU): BF16 / FP32 / MXFP4 U8 pairs."""
    out = {}
    cfg = model.cfg
    for name, p in model.named_master():
        p = p.detach().float().cpu()
        if name.split(".")[-2:] in (["experts", "w1"], ["experts", "w2"], ["experts", "w3"]):
            base = name[: -len("experts.w1")]
            wn = name[-2:]
            for e in range(p.shape[0]):
                packed, scale = mxfp4.quantize(p[e].double())
                out[f"{LM}{base}experts.{e}.{wn}.weight_packed"] = packed
                out[f"{LM}{base}experts.{e}.{wn}.weight_scale"] = scale
            continue
        if any(name.endswith(s) for s in FP32_TENSORS):
            out[LM + name] = p.clone()
        else:
            out[LM + name] = p.to(torch.bfloat16)
    for L in range(cfg.num_hidden_layers):
        if cfg.is_moe(L):
            out[f"{LM}model.layers.{L}.block_sparse_moe.gate.e_score_correction_bias"] = \
                model.router_bias(L).detach().float().cpu().clone()
    return out


def export(model, out: str, config: dict):
    os.makedirs(out, exist_ok=True)
    tensors = checkpoint_tensors(model)
    names = sorted(tensors)
    shards, cur, size = [], [], 0
    for n in names:
        nb = tensors[n].numel() * tensors[n].element_size()
        if cur and size + nb > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, part in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(out, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
        f.write("\n")
    make_checkpoint.dump_json(config, os.path.join(out, "config.json"))
    write_tokenizer(out, config["text_config"]["vocab_size"])
    return total

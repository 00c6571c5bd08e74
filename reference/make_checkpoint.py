#!/usr/bin/env python3
"""Generate random-weight test checkpoints of Kimi K3.1 Pro in the released on-disk layout.

    python3 reference/make_checkpoint.py --config {nano,mini,full} --out DIR [--seed N] [--shards K]
        [--config-only] [--no-vision] [--fast-experts] [--override key=value ...]

Writes into DIR: config.json (kimi_k3 layout, MODEL.md §1), tiktoken.model + tokenizer_config.json (§7),
model-0000i-of-0000K.safetensors shards + model.safetensors.index.json holding every tensor of §2 with the
released names/shapes/dtypes, routed experts as MXFP4 (§4). Configs: nano / mini = Appendix A, full = the
real K3.1 Pro (config and tokenizer only; its weights would be ~600 GB).

Reproducibility (golden test data depends on it: same config + seed => byte-identical files anywhere):
- Every tensor has its own PCG64 stream seeded from sha256(seed, tensor name), so generation order, the
  shard layout and unrelated config changes never alter a tensor's bytes.
- Only draws that are plain functions of the raw 64-bit PCG64 output are used: full-range `integers()`
  (= raw) and `random()` (= (raw >> 11)·2^-53; a test pins both). Normals come from Box–Muller whose
  log/cos/sin are evaluated here with +,-,*,/ only (series after an exact range reduction). numpy dispatches its own
  transcendental functions to CPU-specific SIMD code (SVML on AVX-512) whose last bits differ between
  machines; IEEE basic operations do not.
- Values go float64 -> float32 (IEEE round-to-nearest) -> BF16 by round-to-nearest-even on the float32 bit
  pattern, done here; the uint16 payload is handed to safetensors with dtype "bfloat16" through its
  TensorSpec API (safetensors' numpy front end has no bfloat16). JSON is written with sorted keys, indent 2.
- safetensors lays a file out sorted by (dtype alignment, name); its version is pinned in requirements.txt.

Layout choices that mirror the release: experts' six tensors are one unit that never straddles shards;
within each MoE layer the experts are listed in a seeded random order before the list is cut into shards,
so expert ids are spread over shards non-monotonically. Shards are cut on cumulative bytes (default
~2 GiB each, at least 4) and written one at a time, so memory stays bounded by about one shard.

Initialisation (keeps a forward pass healthy through all layers; all "norm" weights are 1 + 0.02·N):
linear weights N(0, 1/fan_in), except the layer output projections (KDA/MLA o_proj, dense and shared-expert
down_proj: N(0, 0.03²/fan_in); routed_expert_up_proj: N(0, 0.01²/fan_in)); embeddings N(0, 1); AttnRes
projections N(0, 0.03²/hidden) (see "Conditioning" below OUT_GAIN); short-conv taps
N(0, 0.5²); A_log = log U(0.5, 2) so exp(A_log) = O(1); dt_bias N(0, 0.1²); router correction bias
N(0, 0.01²); indexer k_norm bias N(0, 0.02²); vision position table N(0, 0.02²). Experts: N(0, 1/fan_in)
in float32 quantised with reference/mxfp4.py, or with --fast-experts random E2M1 codes drawn from the code
histogram such weights produce plus per-block E8M0 scales around the same std (no float matrix at all).
"""
import argparse
import base64
import copy
import hashlib
import json
import math
import os
import sys

import numpy as np
from safetensors import TensorSpec, serialize_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DATA = os.path.join(HERE, "data", "test_tokenizer", "tiktoken.model")
LM = "language_model."
NUM_SPECIALS = 256

# ----------------------------------------------------------------------------------------------------------
# config.json

# Per-config values (MODEL.md §1.1 + Appendix A). Everything else in text_config is shared, see text_config().
PRESETS = {
    "nano": dict(hidden_size=256, num_hidden_layers=8, vocab_size=1024, kda_heads=4, kda_head_dim=32,
                 num_attention_heads=4, head_dim=32, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, index_n_heads=2, index_head_dim=32, index_topk=64,
                 intermediate_size=512, num_experts=16, num_experts_per_token=4, routed_expert_hidden_size=128,
                 moe_intermediate_size=64, num_shared_experts=2, shared_width=128, attn_res_block_size=3),
    "mini": dict(hidden_size=7168, num_hidden_layers=8, vocab_size=163840, kda_heads=12, kda_head_dim=128,
                 num_attention_heads=12, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, index_n_heads=32, index_head_dim=128, index_topk=2048,
                 intermediate_size=4224, num_experts=112, num_experts_per_token=2,
                 routed_expert_hidden_size=3584, moe_intermediate_size=3072, num_shared_experts=2,
                 shared_width=768, attn_res_block_size=3),
    "full": dict(hidden_size=7168, num_hidden_layers=93, vocab_size=163840, kda_heads=96, kda_head_dim=128,
                 num_attention_heads=96, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, index_n_heads=32, index_head_dim=128, index_topk=2048,
                 intermediate_size=33792, num_experts=896, num_experts_per_token=16,
                 routed_expert_hidden_size=3584, moe_intermediate_size=3072, num_shared_experts=2,
                 shared_width=6144, attn_res_block_size=12),
}

VISION_FULL = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "qkv_hidden_size": 1536, "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "attn_bias": False, "patch_embed_proj_bias": False,
    "linear_bias": False, "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
    "pos_emb_interpolation_mode": "bilinear", "text_hidden_size": 7168,
}
VISION_NANO = dict(VISION_FULL, vt_hidden_size=32, vt_num_attention_heads=2, qkv_hidden_size=32,
                   vt_num_hidden_layers=2, vt_intermediate_size=64, init_pos_emb_height=8, init_pos_emb_width=8)

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                        "group_size": 32, "scale_dtype": "torch.uint8"},
            "input_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

# Named special slots, as offsets from the first special id (MODEL.md §7). Unnamed slots are
# `<|reserved_token_{id}|>` with the ABSOLUTE id, as the Kimi tiktoken tokenizer names them.
SPECIAL_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                 9: "[EOT]", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
                 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"}


def layer_lists(n_layers):
    """1-indexed (kda_layers, full_attn_layers): MLA = multiples of 4 plus the last layer."""
    full = sorted({i for i in range(1, n_layers + 1) if i % 4 == 0} | {n_layers})
    return [i for i in range(1, n_layers + 1) if i not in full], full


def parse_override(text):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError("--override wants key=value, got %r" % text)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def text_config(preset, overrides=()):
    p = PRESETS[preset]
    first_special = p["vocab_size"] - NUM_SPECIALS
    kda, full = layer_lists(p["num_hidden_layers"])
    tc = {
        "model_type": "kimi_linear",
        "torch_dtype": "bfloat16",
        "hidden_size": p["hidden_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "vocab_size": p["vocab_size"],
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": p["intermediate_size"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_attention_heads"],
        "head_dim": p["head_dim"],
        "q_lora_rank": p["q_lora_rank"],
        "kv_lora_rank": p["kv_lora_rank"],
        "qk_nope_head_dim": p["qk_nope_head_dim"],
        "qk_rope_head_dim": p["qk_rope_head_dim"],
        "v_head_dim": p["v_head_dim"],
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": p["num_experts"],
        "num_experts_per_token": p["num_experts_per_token"],
        "routed_expert_hidden_size": p["routed_expert_hidden_size"],
        "moe_intermediate_size": p["moe_intermediate_size"],
        "num_shared_experts": p["num_shared_experts"],
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "attn_res_block_size": p["attn_res_block_size"],
        "num_nextn_predict_layers": 0,
        "bos_token_id": first_special + 0,
        "eos_token_id": first_special + 2,
        "pad_token_id": first_special + 255,
        "index_n_heads": p["index_n_heads"],
        "index_head_dim": p["index_head_dim"],
        "index_topk": p["index_topk"],
        "linear_attn_config": {
            "head_dim": p["kda_head_dim"], "num_heads": p["kda_heads"], "short_conv_kernel_size": 4,
            "use_full_rank_gate": True, "gate_lower_bound": -5.0, "kda_layers": kda, "full_attn_layers": full,
        },
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
    }
    overridden = set()
    for key, value in overrides:
        node, parts = tc, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        overridden.add(key)
    # Derived fields follow the overrides unless they were overridden themselves.
    lac = tc["linear_attn_config"]
    kda, full = layer_lists(tc["num_hidden_layers"])
    for name, value in (("kda_layers", kda), ("full_attn_layers", full)):
        if "linear_attn_config." + name not in overridden:
            lac[name] = value
    if "num_key_value_heads" not in overridden:
        tc["num_key_value_heads"] = tc["num_attention_heads"]
    first_special = tc["vocab_size"] - NUM_SPECIALS
    for name, off in (("bos_token_id", 0), ("eos_token_id", 2), ("pad_token_id", 255)):
        if name not in overridden:
            tc[name] = first_special + off
    # Not a release field: written only when the fused shared-expert width is not the release's
    # moe_intermediate_size × num_shared_experts (mini keeps the TP8 shard 768 of 6144).
    derived_shared = tc["moe_intermediate_size"] * tc["num_shared_experts"]
    shared = p["shared_width"] if preset == "mini" else derived_shared
    shared = tc.get("shared_experts_intermediate_size", shared)
    if shared != derived_shared:
        tc["shared_experts_intermediate_size"] = shared
    validate(tc)
    return tc


def validate(tc):
    lac = tc["linear_attn_config"]
    n = tc["num_hidden_layers"]
    if sorted(lac["kda_layers"] + lac["full_attn_layers"]) != list(range(1, n + 1)):
        raise ValueError("kda_layers and full_attn_layers must cover layers 1..%d exactly once" % n)
    for key in ("routed_expert_hidden_size", "moe_intermediate_size", "index_head_dim"):
        if tc[key] % 32:
            raise ValueError("%s must be a multiple of 32 (MXFP4 blocks)" % key)
    if not 1 <= tc["num_experts_per_token"] <= tc["num_experts"]:
        raise ValueError("need 1 <= num_experts_per_token <= num_experts")
    if tc["vocab_size"] <= NUM_SPECIALS:
        raise ValueError("vocab_size must exceed the %d special slots" % NUM_SPECIALS)


def build_config(preset, overrides=(), vision=True):
    tc = text_config(preset, overrides)
    first_special = tc["vocab_size"] - NUM_SPECIALS
    cfg = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "media_placeholder_token_id": first_special + 21,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "pad_token_id": 0,
        "ignore_index": -100,
        "text_config": tc,
        "quantization_config": copy.deepcopy(tc["quantization_config"]),
    }
    if vision:
        vc = dict(VISION_NANO if preset == "nano" else VISION_FULL)
        vc["text_hidden_size"] = tc["hidden_size"]
        cfg["vision_config"] = vc
    return cfg


def dump_json(obj, path):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------------------
# tokenizer files

def filler_token(rank):
    """Synthetic base token: 0xFF 0xFE + 7 base-254 digits of rank (digits 0x00..0xFD).

    Unreachable by BPE: a merge needs both halves to be tokens. Any prefix of length 2..8 starts with
    0xFF 0xFE and is neither a filler (those have 9 bytes) nor a trained token (UTF-8 text never contains
    0xFE/0xFF); the only other split is 0xFF + a suffix starting with 0xFE, again not a token."""
    digits = []
    for _ in range(7):
        rank, d = divmod(rank, 254)
        digits.append(d)
    return b"\xff\xfe" + bytes(reversed(digits))


def base_vocab(n_base):
    with open(TOKENIZER_DATA, "r", encoding="ascii") as f:
        trained = [base64.b64decode(line.split()[0]) for line in f if line.strip()]
    return trained[:n_base] + [filler_token(r) for r in range(len(trained), n_base)]


def write_tokenizer(out, vocab_size):
    n_base = vocab_size - NUM_SPECIALS
    with open(os.path.join(out, "tiktoken.model"), "w", encoding="ascii", newline="\n") as f:
        f.writelines("%s %d\n" % (base64.b64encode(tok).decode("ascii"), rank)
                     for rank, tok in enumerate(base_vocab(n_base)))
    names = {n_base + i: SPECIAL_NAMES.get(i, "<|reserved_token_%d|>" % (n_base + i)) for i in range(NUM_SPECIALS)}
    decoder = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, name in names.items()}
    dump_json({
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "<|end_of_msg|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }, os.path.join(out, "tokenizer_config.json"))


# ----------------------------------------------------------------------------------------------------------
# deterministic random numbers

_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_HALF_PI = 1.5707963267948966
# Series coefficients, highest power first; truncation error < 1e-13 on the reduced ranges used below.
_LOG_COEF = [2.0 / k for k in range(17, 0, -2)]                                   # 2·atanh(s)/s in s²
_SIN_COEF = [(-1) ** k / math.factorial(2 * k + 1) for k in range(7, -1, -1)]     # sin(x)/x in x²
_COS_COEF = [(-1) ** k / math.factorial(2 * k) for k in range(8, -1, -1)]         # cos(x) in x²
_SGN_COS = np.array([1.0, -1.0, -1.0, 1.0])
_SGN_SIN = np.array([1.0, 1.0, -1.0, -1.0])


def _poly(coefs, x):
    acc = coefs[0] * x
    for c in coefs[1:-1]:
        acc += c
        acc *= x
    acc += coefs[-1]
    return acc


def det_log(u):
    """ln(u) for u > 0 from frexp + odd atanh series; only IEEE basic ops (bit-identical everywhere)."""
    m, e = np.frexp(u)
    small = m < _SQRT_HALF
    m[small] *= 2.0                                           # m in [sqrt(1/2), sqrt(2))
    e = e.astype(np.float64)
    e[small] -= 1.0
    s = (m - 1.0) / (m + 1.0)                                 # |s| <= 0.172
    return e * _LN2 + s * _poly(_LOG_COEF, s * s)


def det_cos_sin_2pi(u):
    """(cos 2πu, sin 2πu) for u in [0, 1): exact quadrant split to |x| <= π/4, then Taylor series."""
    t = u * 4.0
    q = np.floor(t + 0.5)
    x = (t - q) * _HALF_PI                                    # t - q is exact
    x2 = x * x
    c, s = _poly(_COS_COEF, x2), x * _poly(_SIN_COEF, x2)
    qi = q.astype(np.int64) & 3
    odd = (qi & 1).astype(bool)
    cc = np.where(odd, s, c)
    ss = np.where(odd, c, s)
    return cc * _SGN_COS[qi], ss * _SGN_SIN[qi]


class Stream:
    """Per-tensor random stream; chunked draws give the same values as one big draw."""

    def __init__(self, seed, name):
        digest = hashlib.sha256(b"kestrel-ckpt-v1\0%d\0%s" % (seed, name.encode())).digest()
        self.gen = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))

    def raw(self, n):
        """Raw 64-bit PCG64 outputs (full-range integers() returns them unchanged)."""
        return self.gen.integers(0, 1 << 64, size=n, dtype=np.uint64)

    def uniform(self, n):
        """[0, 1) doubles; random() is exactly (raw >> 11)·2^-53 of the same stream (tested)."""
        return self.gen.random(n)

    def normal(self, n):
        pairs = (n + 1) // 2
        u = self.uniform(2 * pairs)
        r = np.sqrt(-2.0 * det_log(1.0 - u[0::2]))             # 1-u in (0, 1]
        c, s = det_cos_sin_2pi(u[1::2])
        z = np.empty(2 * pairs)
        z[0::2], z[1::2] = r * c, r * s
        return z[:n]


def bf16_bits(x):
    """float array -> uint16 BF16 bit patterns (float32 first, then round-to-nearest-even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


# ----------------------------------------------------------------------------------------------------------
# tensor inventory

DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1}
ST_DTYPE = {"BF16": "bfloat16", "F32": "float32", "U8": "uint8"}
CHUNK = 1 << 16          # elements per draw (cache-sized); even, so chunking never changes the stream


class Tensor:
    """One stored tensor. `init` = (kind, args): normal(std, mean) | alog(heads) | expert(key, part)."""

    def __init__(self, name, shape, dtype, init):
        self.name, self.shape, self.dtype, self.init = name, tuple(shape), dtype, init

    @property
    def nbytes(self):
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def lin(name, out, inp, gain=1.0):
    return Tensor(name, (out, inp), "BF16", ("normal", gain / math.sqrt(inp), 0.0))


def norm(name, dim, dtype="BF16"):
    return Tensor(name, (dim,), dtype, ("normal", 0.02, 1.0))


def rand(name, shape, std, dtype="BF16", mean=0.0):
    return Tensor(name, shape, dtype, ("normal", std, mean))


def expert_unit(prefix, e, latent, inter):
    out = []
    for w, (rows, cols) in (("w1", (inter, latent)), ("w2", (latent, inter)), ("w3", (inter, latent))):
        key = "%sexperts.%d.%s.weight" % (prefix, e, w)
        out.append(Tensor(key + "_packed", (rows, cols // 2), "U8", ("expert", key, "packed", rows, cols)))
        out.append(Tensor(key + "_scale", (rows, cols // 32), "U8", ("expert", key, "scale", rows, cols)))
    return out


def permutation(seed, label, n):
    keys = Stream(seed, label).raw(n)
    return np.argsort(keys, kind="stable").tolist()


# Conditioning (reference/README.md "Conditioning of the random nano checkpoint"). Every layer writes into the
# AttnRes stream through one output projection; with the plain 1/fan_in init each write is as large as the
# embedding, every layer re-randomises the stream and a single BF16 flip (or the router/indexer decision it
# moves) is amplified ~×10 per layer. Small output gains keep each layer a small correction to the embedding,
# the routed experts smaller still (a router decision that flips at a near-tie then costs little), and
# AttnRes Mix logits stay O(0.03) so the Mix weights barely move when a small block changes direction.
OUT_GAIN = 0.03          # o_proj (KDA, MLA), mlp.down_proj, shared_experts.down_proj: std OUT_GAIN/sqrt(fan_in)
ROUTED_UP_GAIN = 0.01    # routed_expert_up_proj
RES_LOGIT_STD = 0.03     # AttnRes *_res_proj: std RES_LOGIT_STD/sqrt(hidden), i.e. Mix logits ~ N(0, 0.03²)


def inventory(cfg, seed):
    """Units (lists of tensors that stay together) in storage order."""
    tc = cfg["text_config"]
    lac = tc["linear_attn_config"]
    D, V, nL = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    H, Dk, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    Hm, Q, C = tc["num_attention_heads"], tc["q_lora_rank"], tc["kv_lora_rank"]
    N, R, Dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    Hi, Di = tc["index_n_heads"], tc["index_head_dim"]
    X, Lt, I = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    Is = tc.get("shared_experts_intermediate_size", I * tc["num_shared_experts"])
    res_std = RES_LOGIT_STD / math.sqrt(D)
    units = [[rand(LM + "model.embed_tokens.weight", (V, D), 1.0)]]
    for L in range(nL):
        P = LM + "model.layers.%d." % L
        t = [norm(P + "input_layernorm.weight", D), norm(P + "post_attention_layernorm.weight", D),
             norm(P + "self_attention_res_norm.weight", D), norm(P + "mlp_res_norm.weight", D),
             rand(P + "self_attention_res_proj.weight", (1, D), res_std),
             rand(P + "mlp_res_proj.weight", (1, D), res_std)]
        A = P + "self_attn."
        if (L + 1) in lac["kda_layers"]:
            t += [lin(A + p + "_proj.weight", H * Dk, D) for p in "qkvg"]
            t += [rand(A + p + "_conv1d.weight", (H * Dk, 1, W), 0.5, "F32") for p in "qkv"]
            t += [lin(A + "f_a_proj.weight", Dk, D), lin(A + "f_b_proj.weight", H * Dk, Dk),
                  lin(A + "b_proj.weight", H, D),
                  Tensor(A + "A_log", (-(-H // 128) * 128,), "F32", ("alog", H)),
                  rand(A + "dt_bias", (H * Dk,), 0.1, "F32"), norm(A + "o_norm.weight", Dk, "F32"),
                  lin(A + "o_proj.weight", D, H * Dk, OUT_GAIN)]
        else:
            t += [lin(A + "q_a_proj.weight", Q, D), norm(A + "q_a_layernorm.weight", Q),
                  lin(A + "q_b_proj.weight", Hm * (N + R), Q), lin(A + "kv_a_proj_with_mqa.weight", C + R, D),
                  norm(A + "kv_a_layernorm.weight", C), lin(A + "kv_b_proj.weight", Hm * (N + Dv), C),
                  lin(A + "g_proj.weight", Hm * Dv, D), lin(A + "o_proj.weight", D, Hm * Dv, OUT_GAIN),
                  lin(A + "indexer.wq_b.weight", Hi * Di, Q), lin(A + "indexer.wk.weight", Di, D),
                  norm(A + "indexer.k_norm.weight", Di), rand(A + "indexer.k_norm.bias", (Di,), 0.02),
                  lin(A + "indexer.weights_proj.weight", Hi, D)]
        moe = L >= tc["first_k_dense_replace"] and L % tc["moe_layer_freq"] == 0
        if not moe:
            F = tc["intermediate_size"]
            t += [lin(P + "mlp.gate_proj.weight", F, D), lin(P + "mlp.up_proj.weight", F, D),
                  lin(P + "mlp.down_proj.weight", D, F, OUT_GAIN)]
            units += [[x] for x in t]
            continue
        M = P + "block_sparse_moe."
        t += [lin(M + "gate.weight", X, D), rand(M + "gate.e_score_correction_bias", (X,), 0.01, "F32"),
              lin(M + "routed_expert_down_proj.weight", Lt, D), norm(M + "routed_expert_norm.weight", Lt),
              lin(M + "routed_expert_up_proj.weight", D, Lt, ROUTED_UP_GAIN),
              lin(M + "shared_experts.gate_proj.weight", Is, D), lin(M + "shared_experts.up_proj.weight", Is, D),
              lin(M + "shared_experts.down_proj.weight", D, Is, OUT_GAIN)]
        units += [[x] for x in t]
        units += [expert_unit(M, e, Lt, I) for e in permutation(seed, "expert-order:" + M, X)]
    units += [[norm(LM + "model.norm.weight", D)], [norm(LM + "model.output_attn_res_norm.weight", D)],
              [rand(LM + "model.output_attn_res_proj.weight", (1, D), res_std)],
              [lin(LM + "lm_head.weight", V, D)]]
    vc = cfg.get("vision_config")
    if vc:
        vt, p, qkv, vi = vc["vt_hidden_size"], vc["patch_size"], vc["qkv_hidden_size"], vc["vt_intermediate_size"]
        mk = math.prod(vc["merge_kernel_size"]) * vt
        T = "vision_tower."
        units += [[rand(T + "patch_embed.proj.weight", (vt, 3, p, p), 1.0 / math.sqrt(3 * p * p))],
                  [rand(T + "patch_embed.pos_emb.weight",
                        (vc["init_pos_emb_height"], vc["init_pos_emb_width"], vt), 0.02)]]
        for b in range(vc["vt_num_hidden_layers"]):
            B = T + "encoder.blocks.%d." % b
            units += [[norm(B + "norm0.weight", vt)], [norm(B + "norm1.weight", vt)],
                      [lin(B + "wqkv.weight", 3 * qkv, vt)], [lin(B + "wo.weight", vt, qkv)],
                      [lin(B + "mlp.fc0.weight", vi, vt)], [lin(B + "mlp.fc1.weight", vt, vi)]]
        units += [[norm(T + "encoder.final_layernorm.weight", vt)],
                  [lin("mm_projector.proj.0.weight", mk, mk)],
                  [lin("mm_projector.proj.2.weight", vc["text_hidden_size"], mk)],
                  [norm("mm_projector.post_norm.weight", vc["text_hidden_size"])]]
    return units


# ----------------------------------------------------------------------------------------------------------
# values

# Fast experts: |code| histogram of N(0,1)/scale with the §0.9 scale rule (block max lands in (3, 6]),
# as cumulative thresholds on a 16-bit uniform; measured once from real quantised blocks, then frozen.
_FAST_CUM = np.array([7001, 20392, 32202, 41912, 52501, 60653, 64893], dtype=np.uint64)
_FAST_CODE_STD = 1.93          # std of the decoded codes above, in units of the block scale


def normal_values(stream, n, std, mean, dtype):
    """Draw in chunks into the final dtype so huge tensors never exist as float64."""
    out = np.empty(n, dtype=np.uint16 if dtype == "BF16" else np.float32)
    for start in range(0, n, CHUNK):
        v = mean + std * stream.normal(min(CHUNK, n - start))
        out[start:start + len(v)] = bf16_bits(v) if dtype == "BF16" else v.astype(np.float32)
    return out


def fast_expert(seed, key, rows, cols):
    s = Stream(seed, key)
    n = rows * cols
    r16 = (s.raw(n) & np.uint64(0xFFFF))
    mag = np.zeros(n, dtype=np.uint8)
    for thr in _FAST_CUM:
        mag += (r16 >= thr)
    sign = (s.raw(n) & np.uint64(1)).astype(np.uint8) << 3
    code = (mag | sign).reshape(rows, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    m, p = math.frexp(_FAST_CODE_STD * math.sqrt(cols))            # exponent of std(codes)·sqrt(fan_in)
    e_base = 127 - (p if m > 0.7071067811865476 else p - 1)
    jitter = np.array([-1, 0, 0, 1], dtype=np.int64)[(s.raw(rows * (cols // 32)) & np.uint64(3)).astype(np.int64)]
    scale = (e_base + jitter).astype(np.uint8).reshape(rows, cols // 32)
    return packed, scale


def expert_arrays(seed, key, rows, cols, fast):
    if fast:
        return fast_expert(seed, key, rows, cols)
    w = (Stream(seed, key).normal(rows * cols) * (1.0 / math.sqrt(cols))).astype(np.float32)
    return mxfp4.quantize_mxfp4(w.reshape(rows, cols))


def materialise(units_tensors, seed, fast):
    """Tensor list -> {name: array}; an expert's packed/scale pair comes from one draw."""
    out, pending = {}, {}
    for t in units_tensors:
        kind = t.init[0]
        if kind == "normal":
            _, std, mean = t.init
            arr = normal_values(Stream(seed, t.name), math.prod(t.shape), std, mean, t.dtype)
        elif kind == "alog":
            heads = t.init[1]
            arr = np.zeros(t.shape, dtype=np.float32)
            arr[:heads] = det_log(0.5 + 1.5 * Stream(seed, t.name).uniform(heads))
        elif kind == "expert":
            _, key, part, rows, cols = t.init
            if key not in pending:
                pending[key] = expert_arrays(seed, key, rows, cols, fast)
            arr = pending[key][0 if part == "packed" else 1]
        else:
            raise AssertionError(kind)
        out[t.name] = np.ascontiguousarray(arr).reshape(t.shape)
    return out


# ----------------------------------------------------------------------------------------------------------
# sharding and writing

SHARD_TARGET = 2 << 30


def plan_shards(units, n_shards=None):
    total = sum(t.nbytes for u in units for t in u)
    if n_shards is None:
        n_shards = max(4, -(-total // SHARD_TARGET))
    n_shards = max(1, min(n_shards, len(units)))
    shards, cum = [[]], 0
    for i, unit in enumerate(units):
        if shards[-1] and len(shards) < n_shards and (
                cum >= total * len(shards) / n_shards or len(units) - i <= n_shards - len(shards)):
            shards.append([])
        shards[-1].extend(unit)
        cum += sum(t.nbytes for t in unit)
    return shards, total


def write_shard(path, tensors, arrays):
    specs = {}
    for t in tensors:
        a = arrays[t.name]
        assert a.nbytes == t.nbytes and a.flags.c_contiguous, t.name
        specs[t.name] = TensorSpec(dtype=ST_DTYPE[t.dtype], shape=list(t.shape), data_ptr=a.ctypes.data,
                                   data_len=a.nbytes)
    serialize_file(specs, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)        # safetensors creates 0600; shards are shared read-only test data


def generate(preset, out, seed=0, n_shards=None, config_only=False, vision=True, overrides=(),
             fast_experts=False, log=None):
    if preset == "full" and not config_only:
        raise SystemExit("--config full only supports --config-only (the real weights are ~600 GB)")
    os.makedirs(out, exist_ok=True)
    cfg = build_config(preset, overrides, vision)
    dump_json(cfg, os.path.join(out, "config.json"))
    write_tokenizer(out, cfg["text_config"]["vocab_size"])
    if config_only:
        return cfg
    shards, total = plan_shards(inventory(cfg, seed), n_shards)
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (k + 1, len(shards))
        arrays = materialise(tensors, seed, fast_experts)
        write_shard(os.path.join(out, fname), tensors, arrays)
        del arrays
        weight_map.update((t.name, fname) for t in tensors)
        if log:
            log("%s: %d tensors" % (fname, len(tensors)))
    dump_json({"metadata": {"total_size": total}, "weight_map": weight_map},
              os.path.join(out, "model.safetensors.index.json"))
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate a random-weight Kimi K3.1 Pro test checkpoint.")
    ap.add_argument("--config", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=None, help="number of shards (default: ~2 GiB each, >= 4)")
    ap.add_argument("--config-only", action="store_true", help="write config.json + tokenizer files only")
    ap.add_argument("--no-vision", action="store_true", help="omit vision_config and vision/projector tensors")
    ap.add_argument("--fast-experts", action="store_true",
                    help="draw E2M1 codes + scales directly instead of quantising floats (for mini)")
    ap.add_argument("--override", action="append", default=[], type=parse_override, metavar="KEY=VALUE",
                    help="set a text_config field (dotted for nested, JSON value), e.g. num_experts=4")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    if os.path.isdir(args.out):
        for f in os.listdir(args.out):
            if f.startswith("model-") and f.endswith(".safetensors"):
                os.remove(os.path.join(args.out, f))     # stale shards of another layout
    generate(args.config, args.out, args.seed, args.shards, args.config_only, not args.no_vision,
             args.override, args.fast_experts, log=lambda s: print(s, file=sys.stderr))


if __name__ == "__main__":
    main()

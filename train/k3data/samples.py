"""Training samples: generated conversations -> token ids + per-token loss weights, packed into rows.

A sample is encoded with chat.encode_training; its loss weight is 1 on the assistant turns (what the model
generates) and `context_weight` (default 0.1) on every other token, so the model also learns the statistics of
the prompts it reads (filler text, tool schemas) without their unpredictable parts (keys, numbers) dominating.
Rows of `seq_len` are packed greedily from consecutive samples, each followed by [EOS] (weight 0); a sample
longer than a row is cut.  Sample i is drawn with seed i (task chosen by the same seed), seeds < 1,000,000.
numpy only (no torch): CI can test it.
"""
from __future__ import annotations

import random

import numpy as np

from . import chat, gen

MIX = (("passkey", 0.3), ("tool", 0.3), ("arith", 0.3), ("chat", 0.1))
TRAIN_SEED_LIMIT = 1_000_000


def conversation(seed: int, seq_len: int):
    r = random.Random(seed * 7919 + 17)
    x = r.random()
    acc = 0.0
    task = MIX[-1][0]
    for name, p in MIX:
        acc += p
        if x < acc:
            task = name
            break
    if task == "passkey":
        return gen.passkey(seed, context_tokens=r.randint(128, seq_len - 200))
    return gen.GENERATORS[task](seed)


def encode_sample(tok, conv, context_weight=0.1):
    ids, mask = chat.encode_training(tok, conv["messages"], tools=conv.get("tools"),
                                     reasoning_effort=conv.get("reasoning_effort"))
    w = np.where(np.asarray(mask, dtype=bool), 1.0, context_weight).astype(np.float32)
    return np.asarray(ids, dtype=np.int32), w


def rows(tok, seq_len: int, start_seed: int, stride: int = 1, context_weight=0.1):
    """Infinite generator of (ids [seq_len] int32, weights [seq_len] float32, next_seed)."""
    eos = tok.special("[EOS]")
    pad = tok.special("[PAD]")
    seed = start_seed
    buf_ids, buf_w = [], []
    n = 0
    while True:
        conv = conversation(seed % TRAIN_SEED_LIMIT, seq_len)
        seed += stride
        ids, w = encode_sample(tok, conv, context_weight)
        ids, w = ids[: seq_len - 1], w[: seq_len - 1]
        if n + len(ids) + 1 > seq_len and n > 0:
            out_i = np.full(seq_len, pad, dtype=np.int32)
            out_w = np.zeros(seq_len, dtype=np.float32)
            out_i[:n] = np.concatenate(buf_ids)
            out_w[:n] = np.concatenate(buf_w)
            yield out_i, out_w, seed
            buf_ids, buf_w, n = [], [], 0
        buf_ids += [ids, np.asarray([eos], dtype=np.int32)]
        buf_w += [w, np.zeros(1, dtype=np.float32)]
        n += len(ids) + 1

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


def rows(tok, seq_len: int, start_seed: int, stride: int = 1, context_weight=0.1, mix_len: int | None = None,
         long=None, forget=None):
    """Infinite generator of (ids [seq_len] int32, weights [seq_len] float32, next_seed).
    `mix_len` (default seq_len) sizes the mix's passkey prompts: a long-context stage passes 2048 to keep the
    original pre-training passkeys in its packed rows; the long ones come only from `long`.
    `long` (optional): (frac, min_tokens, max_tokens[, shallow]) — that fraction of rows starts with one long
    passkey sample (long_passkey) and is filled up with the packed mix; a fraction `shallow` of those puts the key
    in the first tenth of its filler (depth uniform in [0, 0.1), the farthest from the question), the others at a
    uniformly random depth.
    `forget` (optional, with `long`): (frac, width) — that fraction of the long passkeys gets a forget window of
    `width` tokens at a uniformly random place between the needle's end and the question (forget_span); the rows
    are then (ids, weights, next_seed, forget [seq_len] bool), True on the window, and the trainer sets every KDA
    layer's decay there to its floor (K3Model.kda), so that the key can only come back through the MLA layers.
    Without `forget` the rows are 3-tuples, exactly the ones they always were."""
    eos = tok.special("[EOS]")
    pad = tok.special("[PAD]")
    seed = start_seed
    pending = None   # a mix sample that did not fit the previous row opens the next one
    while True:
        buf_ids, buf_w, n = [], [], 0
        fmask = np.zeros(seq_len, dtype=bool) if forget is not None else None
        if long is not None:
            # the row's fate hangs on the next seed; a long row takes that seed for its passkey (the mix never
            # draws it), so every row moves the stream on and no two long samples share a seed. It goes first,
            # so it always fits whole (question and answer included).
            r = random.Random(seed * 7907 + 3)
            if r.random() < long[0]:
                tokens = r.randint(long[1], long[2])
                # drawn only when asked, so rows without `shallow` are the ones they always were
                depth = r.uniform(0.0, 0.1) if len(long) > 3 and long[3] > 0 and r.random() < long[3] else None
                ids, w = long_passkey(tok, seed % TRAIN_SEED_LIMIT, tokens, seq_len, context_weight, depth)
                if forget is not None and forget[0] > 0 and r.random() < forget[0]:   # drawn after the above
                    lo, hi = forget_span(tok, ids, forget[1])
                    if lo <= hi:
                        p = r.randint(lo, hi)
                        fmask[p:p + forget[1]] = True
                seed += stride
                buf_ids += [ids, np.asarray([eos], dtype=np.int32)]
                buf_w += [w, np.zeros(1, dtype=np.float32)]
                n += len(ids) + 1
        while True:
            if pending is None:
                conv = conversation(seed % TRAIN_SEED_LIMIT, mix_len or seq_len)
                seed += stride
                ids, w = encode_sample(tok, conv, context_weight)
                pending = ids[: seq_len - 1], w[: seq_len - 1]
            ids, w = pending
            if n + len(ids) + 1 > seq_len and n > 0:
                break
            buf_ids += [ids, np.asarray([eos], dtype=np.int32)]
            buf_w += [w, np.zeros(1, dtype=np.float32)]
            n += len(ids) + 1
            pending = None
        out_i = np.full(seq_len, pad, dtype=np.int32)
        out_w = np.zeros(seq_len, dtype=np.float32)
        out_i[:n] = np.concatenate(buf_ids)[:seq_len]
        out_w[:n] = np.concatenate(buf_w)[:seq_len]
        yield (out_i, out_w, seed) if forget is None else (out_i, out_w, seed, fmask)


# gen.passkey without a tokenizer sizes its filler at 1.25 tokens per word; the test vocabulary spends ~1.5
# on this filler, so the first try asks for tokens / 1.2 and a rescaled retry fixes the rest
_FILLER_RATIO = 1.2


def long_passkey(tok, seed: int, tokens: int, seq_len: int, context_weight=0.1, depth: float | None = None):
    """One passkey sample of about `tokens` tokens (key at `depth`, default the seed's random depth), never longer
    than seq_len - 1 so the question and answer are never cut off.  Returns (ids, weights) as encode_sample does."""
    want = min(tokens, seq_len - 1)
    target = int(want / _FILLER_RATIO)
    for _ in range(4):
        ids, w = encode_sample(tok, gen.passkey(seed, context_tokens=target, depth=depth), context_weight)
        if len(ids) <= seq_len - 1 and len(ids) >= 0.9 * want:
            break
        target = max(64, int(target * want / len(ids) * (0.99 if len(ids) > want else 1.0)))
    if len(ids) > seq_len - 1:
        raise ValueError(f"passkey seed {seed}: {len(ids)} tokens do not fit a {seq_len}-token row")
    return ids, w


def forget_span(tok, ids, width: int):
    """(lo, hi): the first and last token a `width`-token forget window may start at in a passkey sample's ids —
    after the needle's last token ("... {key} is the pass key.") and ending before the question's first token, so
    the needle is written to the KDA states before the window and the question read after it. lo > hi when the
    filler between them is shorter than the window (a needle at depth 1)."""
    full, ends = decoded_ends(tok, ids)
    key_at = full.index("The pass key is ") + len("The pass key is ")
    key = full[key_at:key_at + 5]
    needle_end = full.index(f"{key} is the pass key.", key_at) + len(f"{key} is the pass key.")
    question = full.index(gen.PASSKEY_Q.strip(), needle_end)
    lo = int(np.searchsorted(ends, needle_end, side="left")) + 1        # the token after the needle's last
    first_q = int(np.searchsorted(ends, question, side="right"))        # the token holding the question's start
    return lo, first_q - width


def decoded_ends(tok, ids):
    """(text, ends): the ids decoded one token at a time and joined, and ends[i] = the text offset just past token
    i — so the token holding character c is searchsorted(ends, c, side="right")."""
    texts = [tok.decode([int(i)]) for i in ids]
    return "".join(texts), np.cumsum([len(t) for t in texts])

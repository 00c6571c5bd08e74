#!/usr/bin/env python3
"""Trains the small byte-level BPE vocabulary used by the tokenizer golden tests.

Moonshot's 163,840-entry vocabulary is not available here, so the golden tests need a stand-in
that exercises the same code paths: many multi-byte merges in CJK, Cyrillic, Arabic, emoji and
code. This script trains one deterministically on text shipped in Debian packages (license texts,
gettext catalogues of many languages, Python's standard library) plus generated emoji sequences,
and writes it in Moonshot's file format (tiktoken.model + tokenizer_config.json with the K3
special-token names at their MODEL.md §7 offsets). Its output is committed; rerun only to change it:

    python3 tests/py/make_test_vocab.py --out tests/data/tok_golden --size 12000
"""
import argparse
import base64
import collections
import gettext
import glob
import heapq
import json
import os
import random
import re

# MODEL.md §7: offsets of the named specials from the first special id; the other slots of the 256
# are reserved (named by the loader).
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    9: "[EOT]", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    254: "[UNK]", 255: "[PAD]",
}

LANGS = ["zh_CN", "zh_TW", "ja", "ko", "ru", "uk", "ar", "he", "fa", "hi", "el", "th", "vi", "de", "fr",
         "es", "pl", "tr", "ka", "hy", "bn", "ta"]


def mo_texts(lang, limit_chars):
    out, total = [], 0
    for path in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as f:
                cat = gettext.GNUTranslations(f)._catalog
        except Exception:
            continue
        for key in sorted(cat, key=str):
            v = cat[key]
            if isinstance(v, str) and v:
                out.append(v)
                total += len(v)
        if total > limit_chars:
            break
    return out


def corpus():
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            texts.append(open(path, encoding="utf-8", errors="replace").read())
    for lang in LANGS:
        texts.extend(mo_texts(lang, 400_000))
    for path in sorted(glob.glob("/usr/lib/python3*/*.py"))[:150]:
        texts.append(open(path, encoding="utf-8", errors="replace").read())
    rng = random.Random(1)
    emoji = [chr(c) for c in range(0x1F600, 0x1F650)] + [chr(c) for c in range(0x1F300, 0x1F380)]
    for _ in range(20000):
        e = rng.choice(emoji)
        if rng.random() < 0.3:
            e += rng.choice(["\U0001F3FB", "\U0001F3FD", "\u200d\u2640\ufe0f", "\u200d\U0001F4BB"])
        texts.append(e)
    return texts


# Rough word split for training only; the merges just need to be plausible, not tied to pat_str.
SPLIT = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")


def train(texts, size):
    counts = collections.Counter()
    for t in texts:
        for w in SPLIT.findall(t):
            counts[w.encode("utf-8")] += 1
    vocab = [bytes([b]) for b in range(256)]
    words = [[list(w), c] for w, c in sorted(counts.items())]
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for wi, (sym, c) in enumerate(words):
        for a, b in zip(sym, sym[1:]):
            pair_count[(a, b)] += c
            where[(a, b)].add(wi)
    heap = [(-c, vocab[a] + vocab[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    seen = set(vocab)
    while len(vocab) < size and heap:
        negc, merged, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or -negc <= 0:
            continue
        if merged in seen:  # same bytes reached by another pair: keep ranks unique
            pair_count[pair] = 0
            continue
        new = len(vocab)
        vocab.append(merged)
        seen.add(merged)
        touched = collections.Counter()
        for wi in list(where.pop(pair, ())):
            sym, c = words[wi]
            for a, b in zip(sym, sym[1:]):
                touched[(a, b)] -= c
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == pair:
                    out.append(new)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            words[wi][0] = out
            for a, b in zip(out, out[1:]):
                touched[(a, b)] += c
                where[(a, b)].add(wi)
        for p, d in touched.items():
            if d:
                pair_count[p] += d
                if pair_count[p] > 0:
                    heapq.heappush(heap, (-pair_count[p], vocab[p[0]] + vocab[p[1]], p))
        pair_count.pop(pair, None)
    return vocab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=12000)
    args = ap.parse_args()
    vocab = train(corpus(), args.size)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiktoken.model"), "w") as f:
        for rank, b in enumerate(vocab):
            f.write(f"{base64.b64encode(b).decode()} {rank}\n")
    n = len(vocab)
    cfg = {"added_tokens_decoder": {str(n + off): {"content": name, "special": True}
                                    for off, name in sorted(SPECIAL_OFFSETS.items())}}
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"wrote {n} ranks to {args.out}")


if __name__ == "__main__":
    main()

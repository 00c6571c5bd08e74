"""Piece-boundary golden test for the pre-tokenizer.

With a byte-level vocabulary, different piece boundaries can still give the same ids, so this test
makes boundaries visible: it builds a vocabulary holding every character-aligned substring of the
test strings (shorter substrings rank first), so each pre-tokenizer piece encodes to exactly one
token and the id sequence *is* the piece sequence. Strings are short random mixes of characters
chosen to stress the K3 pat_str's classes: Han vs other letters, every letter/mark/number
category, apostrophe contractions (incl. U+017F), CR/LF, exotic whitespace.
"""
import base64
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3tok_reference as R  # noqa: E402
import tiktoken  # noqa: E402
from test_tokenizer_golden import BIN  # noqa: E402


def char_pool(rng):
    by = {}
    for c in range(0x30000):
        if 0xD800 <= c < 0xE000:
            continue
        by.setdefault(unicodedata.category(chr(c)), []).append(chr(c))
    pool = list("aAzZ'sStTrRlLdDmMvVeE017 \t\r\n.,!-_中日本")
    pool += ["\u017f", "\u212a", "\u3005", "\u3007", "\u2e80", "\u3021", "\u00a0", "\u3000", "\u2028", "\x1c",
             "\x85", "\u200b", "\ufe0f", "\u200d", "\u0301", "\u20e3", "\U0001F600"]
    for cat, chars in sorted(by.items()):
        if cat in ("Cn", "Cs"):
            continue
        pool += rng.sample(chars, min(len(chars), 12))
    return pool


def test_piece_boundaries_match_tiktoken():
    rng = random.Random(99)
    pool = char_pool(rng)
    strings = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 9))) for _ in range(6000)]
    subs = set()
    for s in strings:
        for i in range(len(s)):
            for j in range(i + 1, len(s) + 1):
                subs.add(s[i:j].encode("utf-8"))
    ranks = {bytes([b]): b for b in range(256)}
    for t in sorted(subs, key=lambda b: (len(b), b)):
        if t not in ranks:
            ranks[t] = len(ranks)
    # Byte prefixes of multi-byte characters are not needed: whole pieces are always in the vocabulary.
    enc = tiktoken.Encoding("pieces", pat_str=R.K3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tiktoken.model"), "w") as f:
            for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
                f.write(f"{base64.b64encode(t).decode()} {r}\n")
        inp = "\n".join(json.dumps({"text": s}) for s in strings) + "\n"
        res = subprocess.run([BIN, "tokenize", "--model", d, "--jsonl"], input=inp.encode(), capture_output=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr.decode(errors="replace")
    got = [json.loads(l)["ids"] for l in res.stdout.decode().split("\n") if l]
    bad = []
    for s, g in zip(strings, got):
        want = enc.encode_ordinary(s)
        if g != want:
            bad.append((s, [enc.decode_single_token_bytes(i).decode() for i in want],
                        [enc.decode_single_token_bytes(i).decode("utf-8", "replace") for i in g]))
    print(f"pieces: {len(strings) - len(bad)}/{len(strings)} identical")
    assert not bad, bad[:10]

"""Reference K3 tokenization in Python, for the golden tests of the C++ tokenizer.

The reference is PyPI `tiktoken` (Rust fancy-regex pre-tokenizer + BPE) configured with the K3
pat_str, the test vocabulary's ranks and its special tokens, wrapped in Moonshot's chunking rules
(400,000-character chunks; runs of more than 25,000 str.isspace()/non-space characters split).
Raw bytes are mapped to text with bytes.decode("utf-8", "replace"): that is kestrel's documented
behaviour for invalid UTF-8 input (each maximal ill-formed subpart becomes U+FFFD).
"""
import base64
import json
import os

import tiktoken

K3_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000
NUM_RESERVED_SPECIAL = 256

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_VOCAB_DIR = os.path.join(REPO, "tests", "data", "tok_golden")


def load_encoding(model_dir=GOLDEN_VOCAB_DIR):
    ranks = {}
    with open(os.path.join(model_dir, "tiktoken.model")) as f:
        for line in f:
            if line.strip():
                b64, rank = line.split()
                ranks[base64.b64decode(b64)] = int(rank)
    n = len(ranks)
    names = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            for k, v in json.load(f).get("added_tokens_decoder", {}).items():
                names[int(k)] = v["content"]
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL)}
    return tiktoken.Encoding("k3_test", pat_str=K3_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def split_runs(s, limit):
    """Parts of s with no more than `limit` consecutive isspace() or non-isspace() characters."""
    if not s:
        yield s
        return
    run_space = s[0].isspace()
    run_len = 0
    start = 0
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if sp != run_space:
            run_space = sp
            run_len = 1
        else:
            run_len += 1
            if run_len > limit:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


def reference_encode(enc, text, allow_special=False):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    ids = []
    for c in range(0, len(text), MAX_ENCODE_CHARS):
        for part in split_runs(text[c:c + MAX_ENCODE_CHARS], MAX_SAME_CLASS_RUN):
            if allow_special:
                ids.extend(enc.encode(part, allowed_special="all"))
            else:
                ids.extend(enc.encode(part, disallowed_special=()))
    return ids

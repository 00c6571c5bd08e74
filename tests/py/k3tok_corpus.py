"""Deterministic generator of the tokenizer golden corpus.

Each case is a dict {"text": str} or {"raw": bytes} plus "special": bool. The mix covers what the
issue lists: ASCII prose, code, camelCase/ALLCAPS words and contractions in every case, CJK, emoji
and ZWJ sequences, combining marks, RTL scripts, digits of many scripts, long and exotic
whitespace, invalid UTF-8, and special-token text inside content. Characters are drawn from
Unicode 14.0 assignments (Python's unicodedata) so the property data of tiktoken's Rust regex,
ICU and Python agree on them.
"""
import random
import sys
import unicodedata

WORDS = ("the of and to in is was for that with as on by at from his her they this have are not but "
         "had which one you were all we when there can an been has more will if who would its other "
         "model token kernel tensor cache layer expert router attention server request stream").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D",
                "'\u017f", "'x", "'", "''", "'rE", "'lL"]
CODE = [
    "def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "if err != nil {\r\n\treturn err\r\n}", "const fooBar = await fetchJSON(`/api/${id}`);",
    "#include <vector>\n", "SELECT id, name FROM users WHERE age >= 18;", "x=[1,2,3]\ny={'a':1}",
    "  // comment\n", "std::unique_ptr<HTTPServer> srv;", "a&&b||!c", "#!/bin/bash\necho \"$HOME\"\n",
    "<div class=\"x\">&amp;</div>", "  \t  \n\n\n", "λx.x", "0x7fff_ffff", "1e-10", "i++;--j",
]
SPECIAL_TEXT = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "[BOS]", "<|media_pad|>",
                "<|reserved_token_12100|>", "<|ope", "<|open", "|>", "<|", "[EOT]", "[PAD]",
                "<|kimi_image_placeholder|>", "<|im_end|>"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\x0b",
          "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\u200b", "\u2003", "\u202f", "\u205f", "\u1680", "\ufeff"]
EMOJI_BASE = [0x1F600, 0x1F64F, 0x1F300, 0x1F5FF, 0x1F680, 0x1F6FF, 0x1F900, 0x1F9FF, 0x2600, 0x26FF]


def _assigned(lo, hi, cats=None):
    out = []
    for c in range(lo, hi):
        if 0xD800 <= c < 0xE000:
            continue
        cat = unicodedata.category(chr(c))
        if cat == "Cn" or cat == "Cs":
            continue
        if cats and cat not in cats and cat[0] not in cats:
            continue
        out.append(chr(c))
    return out


class Pools:
    def __init__(self, vocab_strings):
        self.vocab = vocab_strings
        self.all = _assigned(0, 0x32400) + _assigned(0xE0000, 0xE0200)
        by = {}
        for ch in self.all:
            by.setdefault(unicodedata.category(ch), []).append(ch)
        self.by_cat = by
        self.han = _assigned(0x4E00, 0x9FFF) + _assigned(0x3400, 0x4DBF) + _assigned(0x20000, 0x2A6DF) + \
            ["\u3005", "\u3007", "\u2e80", "\u2f00", "\u3021", "\U00016FF0"]
        self.kana = _assigned(0x3040, 0x30FF)
        self.hangul = _assigned(0xAC00, 0xD7A3)
        self.cjk_punct = _assigned(0x3000, 0x303F) + _assigned(0xFF00, 0xFF65)
        self.arabic = _assigned(0x0600, 0x06FF) + _assigned(0x0750, 0x077F)
        self.hebrew = _assigned(0x0590, 0x05FF)
        self.marks = by.get("Mn", []) + by.get("Mc", []) + by.get("Me", [])
        self.digits = by.get("Nd", []) + by.get("Nl", []) + by.get("No", [])
        self.east_asian = self.kana + self.hangul + self.cjk_punct + self.han
        self.rtl = self.arabic + self.hebrew + [" ", " ", "\u200f", "\u200e"]
        self.digits_mix = self.digits + list("0123456789") * 20
        self.cased = by["Lt"] + by["Lm"] + by["Lu"] + by["Ll"][:200]
        self.emoji = []
        for lo, hi in zip(EMOJI_BASE[::2], EMOJI_BASE[1::2]):
            self.emoji += _assigned(lo, hi + 1)


def word(rng):
    w = rng.choice(WORDS)
    r = rng.random()
    if r < 0.15:
        w = w.upper()
    elif r < 0.3:
        w = w.capitalize()
    elif r < 0.4:
        w = w + rng.choice(WORDS).capitalize()  # camelCase
    elif r < 0.45:
        w = w.upper() + rng.choice(WORDS)  # HTTPServer-like
    if rng.random() < 0.15:
        w += rng.choice(CONTRACTIONS)
    return w


def frag(rng, P):
    k = rng.randrange(20)
    if k == 0:
        return " ".join(word(rng) for _ in range(rng.randint(1, 12))) + rng.choice([".", ",", "!", "?", "", "...", ";\n"])
    if k == 1:
        return rng.choice(CODE)
    if k == 2:
        return "".join(rng.choice(P.han) for _ in range(rng.randint(1, 12)))
    if k == 3:
        return "".join(rng.choice(P.east_asian) for _ in range(rng.randint(1, 10)))
    if k == 4:
        s = ""
        for _ in range(rng.randint(1, 4)):
            e = rng.choice(P.emoji)
            r = rng.random()
            if r < 0.3:
                e += "\u200d" + rng.choice(P.emoji)
            elif r < 0.45:
                e += chr(rng.randint(0x1F3FB, 0x1F3FF))
            elif r < 0.55:
                e += "\ufe0f"
            elif r < 0.62:
                e = chr(rng.randint(0x1F1E6, 0x1F1FF)) + chr(rng.randint(0x1F1E6, 0x1F1FF))
            elif r < 0.66:
                e = rng.choice("0123456789#*") + "\ufe0f\u20e3"
            s += e
        return s
    if k == 5:
        s = ""
        for _ in range(rng.randint(1, 6)):
            s += rng.choice([rng.choice("aeiouAEIOU"), rng.choice(P.all), " ", "1", "'", "中"])
            s += "".join(rng.choice(P.marks) for _ in range(rng.randint(0, 3)))
        return s
    if k == 6:
        return "".join(rng.choice(P.rtl) for _ in range(rng.randint(1, 15)))
    if k == 7:
        return "".join(rng.choice(P.digits_mix) for _ in range(rng.randint(1, 12)))
    if k == 8:
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 8)))
    if k == 9:
        return rng.choice(SPECIAL_TEXT)
    if k == 10:
        return "".join(rng.choice(P.all) for _ in range(rng.randint(1, 8)))
    if k == 11:
        cat = rng.choice(["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Zs", "Pc", "Pd",
                          "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Cc", "Cf", "Co"])
        return "".join(rng.choice(P.by_cat[cat]) for _ in range(rng.randint(1, 6)))
    if k == 12:
        return "".join(rng.choice(P.vocab) for _ in range(rng.randint(1, 8)))
    if k == 13:
        return rng.choice(["'", "' ", " '", "'s", "'S", "'\u017f", "'LL", "'ll", "'Re", "'vE"]) + word(rng)
    if k == 14:
        return rng.choice(" \t") * rng.randint(1, 40) + rng.choice(["", "x", "\n", "\n\n  ", "!"])
    if k == 15:
        return str(rng.randint(0, 10 ** rng.randint(1, 15))) + rng.choice(["", ".", ",", "px", " ", "%"])
    if k == 16:
        return "".join(rng.choice(P.cased)
                       for _ in range(rng.randint(1, 6)))
    return rng.choice(P.vocab) + rng.choice([" ", "", "\n", "'s"])


def case(rng, P):
    n = rng.choice([1, 1, 2, 3, 4, 6, 10])
    text = "".join(frag(rng, P) for _ in range(n))
    special = rng.random() < 0.15
    if rng.random() < 0.05:
        raw = bytearray(text.encode("utf-8"))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(raw) + 1)
            if op == 0:
                raw[pos:pos] = bytes([rng.randrange(256)])
            elif op == 1 and raw:
                del raw[min(pos, len(raw) - 1)]
            else:
                raw[pos:pos] = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf0\x9f\x98",
                                           b"\xf4\x90\x80\x80", b"\x80\x80"])
        return {"raw": bytes(raw), "special": special}
    return {"text": text, "special": special}


def long_cases(rng, P):
    """A few large inputs that reach the run-splitting, chunking and long-piece (heap BPE) paths."""
    cases = [
        " " * 30_000 + "x",
        "x" + " " * 25_000 + "y" + " " * 25_001 + "z",
        "a" * 60_000,
        "".join(rng.choice(P.han) for _ in range(6_000)),
        "".join(rng.choice("0123456789") for _ in range(50_001)),
        ("The quick brown fox's tail. " * 16_000)[:410_000] + "中文" + "\n" * 3,
        "\x1c" * 26_000 + "a" * 10,
        "\u3000" * 25_001 + "\u4e00",
        "<|open|>" * 4_000,
    ]
    return [{"text": t, "special": i % 2 == 1} for i, t in enumerate(cases)]


def golden_corpus(vocab_strings, n, seed=20260101):
    rng = random.Random(seed)
    P = Pools(vocab_strings)
    out = long_cases(rng, P)
    while len(out) < n:
        out.append(case(rng, P))
    return out


if __name__ == "__main__":
    import k3tok_reference as R
    enc = R.load_encoding()
    vs = [enc.decode_single_token_bytes(i).decode("utf-8", "replace") for i in range(enc.max_token_value - 255)]
    c = golden_corpus(vs, int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    for x in c[9:29]:
        print(repr(x))

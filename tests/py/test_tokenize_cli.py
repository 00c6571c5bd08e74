"""`kestrel tokenize` from outside: encode matches tiktoken, --decode inverts it, --chat prints the
rendered K3 prompt followed by ids that decode back to it, and bad input exits non-zero."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3tok_reference as R  # noqa: E402
from test_tokenizer_golden import BIN  # noqa: E402


def run(args, inp):
    return subprocess.run([BIN, "tokenize", "--model", R.GOLDEN_VOCAB_DIR, *args], input=inp.encode(),
                          capture_output=True, timeout=60)


def test_encode_decode_chat():
    enc = R.load_encoding()
    text = "Hello, 世界! It's <|open|> 123456 \U0001F600\n"
    r = run([], text)
    assert r.returncode == 0
    ids = [int(x) for x in r.stdout.split()]
    assert ids == R.reference_encode(enc, text)
    assert run(["--decode"], " ".join(map(str, ids))).stdout.decode() == text
    r = run(["--special"], text)
    assert [int(x) for x in r.stdout.split()] == R.reference_encode(enc, text, allow_special=True)

    r = run(["--chat"], '{"messages":[{"role":"user","content":"hi <|sep|>"}],"thinking":false}')
    assert r.returncode == 0
    out = r.stdout.decode()
    prompt, ids_line = out.rstrip("\n").rsplit("\n", 1)
    assert prompt == ('<|open|>message role="user"<|sep|>hi <|sep|><|close|>message<|sep|><|end_of_msg|>'
                      '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    ids = [int(x) for x in ids_line.split()]
    assert enc.decode(ids) == prompt
    # The <|sep|> typed by the user is ordinary text: only the 9 structural specials are special ids.
    assert sum(1 for i in ids if i >= enc.n_vocab - 256) == 9


def test_bad_input_is_an_error_not_a_crash():
    for args, inp in ((["--decode"], "1 x"), (["--decode"], "99999999"), (["--chat"], "{"), (["--chat"], "[]")):
        r = run(args, inp)
        assert r.returncode == 1, (args, inp, r.returncode)
        assert r.stderr

"""The long-context stage's rows (train/README.md "Long-context stage"), without torch: every long row holds one
whole passkey sample (question and answer included) of the asked length at the row's start, the rest of the row is
the original packed mix, the loss weights follow the same rules, seeds stay below the train/eval split, and
without `long` the rows are exactly the original ones."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat, gen, samples  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return chat.Tokenizer(os.path.join(ROOT, "tests", "data", "tok_golden"))


def test_long_passkey_fits_and_has_the_asked_length(tok):
    for seed, want, seq in ((3, 4096, 8192), (7, 8191, 8192), (11, 15000, 16384), (999_999, 300, 1024)):
        ids, w = samples.long_passkey(tok, seed, want, seq)
        assert len(ids) <= seq - 1
        assert 0.9 * min(want, seq - 1) <= len(ids)
        conv = gen.passkey(seed)   # the key depends on the seed only, not on the length
        key = conv["expect"]["answer"]
        text = tok.decode(ids.tolist())
        assert text.count(f"The pass key is {key}.") == 1          # the needle
        assert text.rstrip().endswith(f"{key}<|end_of_msg|>") or key in tok.decode(ids[w == 1.0].tolist())
        assert set(np.unique(w).tolist()) <= {float(np.float32(0.1)), 1.0}


def test_long_rows(tok):
    seq, lo, hi = 8192, 2048, 8000
    pad, eos = tok.special("[PAD]"), tok.special("[EOS]")
    g = samples.rows(tok, seq, 0, mix_len=2048, long=(0.5, lo, hi))
    n_long, last_seed = 0, 0
    for _ in range(24):
        ids, w, seed = next(g)
        assert ids.shape == w.shape == (seq,) and ids.dtype == np.int32 and w.dtype == np.float32
        assert last_seed < seed < samples.TRAIN_SEED_LIMIT
        last_seed = seed
        # samples are [EOS]-separated, each EOS with weight 0; padding (weight 0) only at the end
        n = int((ids != pad).sum())
        assert (ids[n:] == pad).all() and (w[n:] == 0).all() and (ids[:n] != pad).all()
        ends = np.flatnonzero(ids[:n] == eos)
        assert len(ends) >= 1 and ends[-1] == n - 1 and (w[ends] == 0).all()
        first = ids[:ends[0]]
        if len(first) >= lo * 0.9:   # a long row: its first sample is the long passkey, whole
            n_long += 1
            text = tok.decode(first.tolist())
            assert "pass key" in text and text.count("The pass key is ") == 1
            ans = tok.decode(first[w[:ends[0]] == 1.0].tolist())
            key = text.split("The pass key is ")[1][:5]
            assert key in ans
            assert len(first) <= seq - 1
        # the packed mix keeps its original passkey lengths: drawn for mix_len (gen.passkey's 1.25-tokens-per-word
        # estimate; the test vocabulary spends ~1.5, so up to ~2,800 tokens, whole here where a 2K row cut them)
        for a, b in zip(np.r_[-1, ends[:-1]] + 1, ends):
            if a > 0:
                assert b - a < 3000
    assert 6 <= n_long <= 18   # half the rows, give or take


def test_rows_without_long_are_the_original_ones(tok):
    # mix_len defaults to seq_len and long to None: the stream k3-tiny was trained on, bit for bit
    a = samples.rows(tok, 2048, 5, stride=3)
    b = samples.rows(tok, 2048, 5, stride=3, mix_len=2048, long=None)
    for _ in range(10):
        x, y = next(a), next(b)
        assert (x[0] == y[0]).all() and (x[1] == y[1]).all() and x[2] == y[2]


def test_long_rows_are_deterministic(tok):
    a = samples.rows(tok, 4096, 10, stride=2, mix_len=2048, long=(0.7, 1024, 4000))
    b = samples.rows(tok, 4096, 10, stride=2, mix_len=2048, long=(0.7, 1024, 4000))
    for _ in range(6):
        x, y = next(a), next(b)
        assert (x[0] == y[0]).all() and (x[1] == y[1]).all() and x[2] == y[2]


def test_shallow_long_passkeys(tok):
    # --long-shallow: that fraction of the long passkeys has its needle in the first tenth of the filler (the
    # farthest from the question, where k3-tiny misses beyond 32K); shallow = 0 leaves the rows as they were
    seq, lo, hi = 8192, 3000, 8000
    a = samples.rows(tok, seq, 5, mix_len=2048, long=(1.0, lo, hi))
    b = samples.rows(tok, seq, 5, mix_len=2048, long=(1.0, lo, hi, 0.0))
    for _ in range(3):
        x, y = next(a), next(b)
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) and x[2] == y[2]
    eos = tok.special("[EOS]")
    for shallow, lo_frac, hi_frac in ((1.0, 0.0, 0.15), (0.0, 0.0, 1.0)):
        g = samples.rows(tok, seq, 40, mix_len=2048, long=(1.0, lo, hi, shallow))
        where = []
        for _ in range(8):
            ids, _, _ = next(g)
            first = ids[:int(np.flatnonzero(ids == eos)[0])]
            text = tok.decode(first.tolist())
            assert text.count("The pass key is ") == 1
            where.append(text.index("The pass key is ") / len(text))
        assert all(lo_frac <= f <= hi_frac for f in where), where
        if shallow == 0.0:
            assert max(where) > 0.3   # uniform depths reach past the first tenth


def test_forget_windows_sit_between_the_needle_and_the_question(tok):
    # --kda-forget: a `width`-token window after the needle's last token and before the question's first, only
    # in long passkey rows, where the row's own draws put it; without `forget` the rows are the 3-tuples they were
    seq, lo, hi, width = 8192, 3000, 8000, 4
    eos = tok.special("[EOS]")
    a = samples.rows(tok, seq, 7, mix_len=2048, long=(0.6, lo, hi))
    b = samples.rows(tok, seq, 7, mix_len=2048, long=(0.6, lo, hi), forget=(1.0, width))
    n_long = n_win = 0
    for _ in range(10):
        x, y = next(a), next(b)
        assert len(x) == 3 and len(y) == 4
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) and x[2] == y[2]
        ids, f = y[0], y[3]
        assert f.shape == (seq,) and f.dtype == bool
        first = ids[:int(np.flatnonzero(ids == eos)[0])]
        text = tok.decode(first.tolist())
        is_long = len(first) >= 0.9 * lo and text.count("The pass key is ") == 1
        n_long += is_long
        if not f.any():
            continue
        assert is_long
        n_win += 1
        at = np.flatnonzero(f)
        assert len(at) == width and at[-1] - at[0] == width - 1          # one contiguous window
        key = text.split("The pass key is ")[1][:5]
        before = tok.decode(first[:at[0]].tolist())
        after = tok.decode(first[at[-1] + 1:].tolist())
        assert before.count(key) == 2 and f"{key} is the pass key." in before   # the whole needle precedes it
        assert "What is the pass key?" in after and key in after              # the question and answer follow it
    assert n_long >= 3 and n_win >= n_long - 1   # a needle at depth ≈ 1 may leave no room for a window
    c = samples.rows(tok, seq, 7, mix_len=2048, long=(0.6, lo, hi), forget=(0.0, width))
    for _ in range(4):
        assert not next(c)[3].any()


def test_forget_span_bounds(tok):
    # the span's ends are exact: the first start is the token after the needle's last, the last start leaves the
    # window ending on the token before the question's first
    ids, _ = samples.long_passkey(tok, 12, 3000, 4096, depth=0.5)
    lo, hi = samples.forget_span(tok, ids, 4)
    text = lambda a, b: tok.decode(ids[a:b].tolist())  # noqa: E731
    key = text(0, len(ids)).split("The pass key is ")[1][:5]
    assert text(0, lo).endswith(f"{key} is the pass key.") and not text(0, lo - 1).endswith("pass key.")
    assert "What is the pass key?" not in text(0, hi + 4) and "What is the pass key?" in text(0, hi + 5 + 8)
    assert lo < hi

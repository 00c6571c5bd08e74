"""Where a passkey answer comes from (train/README.md "Long-context stage"): one passkey prompt through the trainer's
forward (sparse mode, prefilled in pieces with state as evaluate.generate_batch), teacher-forced on its reference
answer, reporting

- per answer token, whether the model predicts it (greedy) — the reasoning's key, then the content's;
- per MLA layer and answer row, the rank of the needed token's needle copy in the indexer's scores and its
  margin over the best filler key (rank < index_topk: selected);
- with --reset-kda-at P: every KDA layer's recurrent state zeroed at token P (after the needle: does the answer
  still come back through the MLA layers alone?);
- with --topk K: the indexer keeps K keys instead of the config's index_topk (a shorter prompt selecting the same
  fraction as a longer one would).

    python -m k3train.probe_passkey --model-dir ../models/k3-tiny --context 8192 --depth 0 [--reset-kda-at 1024]

The prompt is the eval sets' (gen.passkey(seed, context, depth), make_eval's seeds start at 1,000,001). CPU or
GPU (--device); the prefill's indexer holds [piece, 4, S] scores, so --piece bounds memory at long contexts.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from k3data import chat, gen, samples

from .evaluate import load_exported


def probe(model, tok, context, depth, seed=1_000_001, reset_at=0, piece=4096):
    """Returns {"key", "tokens", "needle" (positions), "answer" [(row, wanted id, predicted id)],
    "ranks" {(layer, row): (rank, margin)}}."""
    rec = gen.passkey(seed, context, depth=depth, tok=tok)
    key = rec["expect"]["answer"]
    ids, mask = chat.encode_training(tok, rec["messages"])
    full, ends = samples.decoded_ends(tok, ids)
    first_gen = mask.index(1)
    spans, j = [], full.find(key)
    while j >= 0:   # every occurrence of the key, as token positions
        a, b = int(np.searchsorted(ends, j, side="right")), int(np.searchsorted(ends, j + len(key) - 1, side="right"))
        spans.append(list(range(a, b + 1)))
        j = full.find(key, j + 1)
    needle = [p for s in spans if s[0] < first_gen for p in s]
    rows = [p - 1 for s in spans if s[0] >= first_gen for p in s]
    ranks, cur = {}, {}
    orig_mla, orig_scores = model.mla, model.indexer_scores

    def mla(L, *a, **k):
        cur["L"] = L
        return orig_mla(L, *a, **k)

    def scores(qI, wts, kI_all, q_lo, S_len):
        I, causal = orig_scores(qI, wts, kI_all, q_lo, S_len)
        for r in rows:
            if q_lo <= r < q_lo + qI.shape[1]:
                v = I[0, r - q_lo, :r + 1]
                tgt = [p for p in needle if ids[p] == ids[r + 1]]
                if tgt:
                    best = max(tgt, key=lambda p: float(v[p]))
                    filler = torch.ones(r + 1, dtype=torch.bool, device=v.device)
                    filler[needle] = False
                    filler[first_gen - 32:] = False   # the question and the template around it
                    ranks[(cur["L"], r)] = (int((v > v[best]).sum()), float(v[best] - v[filler].max()))
        return I, causal

    model.mla, model.indexer_scores = mla, scores
    try:
        dev = next(model.parameters()).device
        st = model.new_state()
        x = torch.tensor([ids], device=dev)
        cuts = sorted(set(range(0, len(ids), piece)) | ({reset_at} if reset_at > 0 else set()))
        pred = {}
        with torch.inference_mode():
            for i, s in enumerate(cuts):
                e = cuts[i + 1] if i + 1 < len(cuts) else len(ids)
                if reset_at > 0 and s == reset_at:
                    for kst in st["kda"].values():
                        kst["S"].zero_()
                h = model.hidden(x[:, s:e], st, "sparse")
                for r in rows:
                    if s <= r < e:
                        pred[r] = int(model.logits(h[0, r - s]).argmax())
    finally:
        model.mla, model.indexer_scores = orig_mla, orig_scores
    return {"key": key, "tokens": len(ids), "needle": needle,
            "answer": [(r, ids[r + 1], pred[r]) for r in rows], "ranks": ranks}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1_000_001)
    ap.add_argument("--reset-kda-at", type=int, default=0, help="zero every KDA state at this token (0: never)")
    ap.add_argument("--topk", type=int, default=0, help="the indexer's kept keys (0: the config's)")
    ap.add_argument("--piece", type=int, default=4096, help="prefill piece (tokens)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    tok = chat.Tokenizer(a.model_dir)
    m = load_exported(a.model_dir, a.device).eval()
    if a.topk:
        m.cfg.index_topk = a.topk
    r = probe(m, tok, a.context, a.depth, a.seed, a.reset_kda_at, a.piece)
    got = "".join(tok.decode([w]) if w == p else f"[{tok.decode([p])}]" for _, w, p in r["answer"])
    print(f"context {a.context} ({r['tokens']} tokens), depth {a.depth}, key {r['key']}, needle at "
          f"{r['needle']}, reset {a.reset_kda_at or '-'}, top-{m.cfg.index_topk}: answer tokens {got}")
    for (L, row), (rank, margin) in sorted(r["ranks"].items()):
        print(f"  layer {L} row {row}: needle rank {rank}, margin {margin:+.3f} over the best filler key")
    return r


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Golden data of the vision tower (MODEL.md §6) and of the text model fed its rows, for the C++ engine.

    python3 reference/make_checkpoint.py --config nano --out /tmp/k3nano --seed 1
    python3 reference/make_golden_vision.py --ckpt /tmp/k3nano --out tests/golden/nano-vision

The vision part is k3ref/vision.py (numpy only); the `prompt` case runs the torch text reference
(k3ref/model.py) with the image rows injected at the <|media_pad|> positions, so this script needs torch.
Outputs `<out>/golden.json` and `<out>/golden.safetensors`:

| name | dtype | shape | meaning |
|---|---|---|---|
| `img{i}.patches` | BF16 | [gh·gw, 3·p·p] | the input (values BF16-exact, uniform in [−1, 1]) |
| `img{i}.embed` | BF16 | [gh·gw, Dvt] | patch embedding + (resized) position table |
| `img{i}.B{b}` | BF16 | [gh·gw, Dvt] | stream after block b |
| `img{i}.final` | BF16 | [gh·gw, Dvt] | after the final RMSNorm |
| `img{i}.out` | BF16 | [gh/2·gw/2, D] | projector output rows (the image's tokens) |
| `prompt.logits` | F32 | [T, V] | text model logits, images 0 and 1 injected at the pads of `prompt.tokens` |
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3ref import vision  # noqa: E402

FORMAT = "kestrel-golden-vision-v1"
# (grid_h, grid_w): below, equal to and above nano's 8×8 position table, square and not
GRIDS = [(2, 2), (4, 6), (6, 4), (8, 8), (12, 10)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from k3ref.loader import Checkpoint
    from k3ref.model import Model
    torch.set_num_threads(1)

    vw = vision.VisionWeights(args.ckpt)
    rng = np.random.default_rng(args.seed)
    pp = 3 * vw.patch * vw.patch
    tensors, images = {}, []
    outs = []
    for i, (gh, gw) in enumerate(GRIDS):
        patches = vision.bf16(rng.uniform(-1.0, 1.0, size=(gh * gw, pp)))
        cap: dict = {}
        out = vision.encode_image(vw, patches, gh, gw, cap)
        outs.append(out)
        tensors[f"img{i}.patches"] = torch.from_numpy(patches).to(torch.bfloat16)
        for k, v in cap.items():
            assert np.array_equal(vision.bf16(v), v), k
            tensors[f"img{i}.{k}"] = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
        images.append({"index": i, "grid_h": gh, "grid_w": gw, "num_tokens": (gh // 2) * (gw // 2),
                       "pos_resized": (gh, gw) != tuple(vw.pos.shape[:2])})
    # varlen: encoding the images together equals encoding each alone (attention stays within an image)
    allrows = vision.encode(vw, [(tensors[f"img{i}.patches"].double().numpy(), gh, gw)
                                 for i, (gh, gw) in enumerate(GRIDS)])
    assert np.array_equal(allrows, np.concatenate(outs))

    # the prompt case: text, image 0 (1 token), text, image 1 (6 tokens), text
    with open(os.path.join(args.ckpt, "config.json")) as f:
        top = json.load(f)
    pad = int(top["media_placeholder_token_id"])
    begin, content, end = pad - 3, pad - 2, pad - 1         # <|media_begin|>, <|media_content|>, <|media_end|>
    n0, n1 = images[0]["num_tokens"], images[1]["num_tokens"]
    toks = [5, 77, 301, begin, content] + [pad] * n0 + [end, 12, 400, 9, begin, content] + [pad] * n1 + \
           [end, 33, 610, 2, 58]
    pad_rows = [j for j, t in enumerate(toks) if t == pad]
    values = torch.from_numpy(np.concatenate([outs[0], outs[1]]))
    ck = Checkpoint(args.ckpt, torch.float64)
    model = Model(ck)
    logits = model.prefill(toks, model.new_state(), embed_override=(pad_rows, values))
    tensors["prompt.logits"] = logits.to(torch.float32).contiguous()
    plain = model.prefill(toks, model.new_state())
    rel_plain = float((logits.double() - plain.double()).norm() / plain.double().norm())

    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "golden.safetensors"),
              metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "generator": "python3 reference/make_golden_vision.py " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "regenerate": ["python3 reference/make_checkpoint.py --config nano --out DIR --seed 1",
                       f"python3 reference/make_golden_vision.py --ckpt DIR --out {args.out}"],
        "checkpoint": {"name": "nano", "sha256": ck.fingerprint()},
        "reference": {"vision": "numpy float64, k3ref/vision.py", "text": f"torch {torch.__version__} float64",
                      "vision_rms_norm_eps": vw.eps, "projector_ln_eps": vw.proj_eps},
        "images": images,
        "prompt": {"tokens": toks, "media_pad_id": pad, "images": [0, 1], "pad_rows": pad_rows,
                   "logits_rel_l2_vs_no_images": rel_plain},
    }
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(os.path.join(args.out, 'golden.safetensors')) / 1e3:.0f} kB); "
          f"logits moved by the images: {rel_plain:.3f}")


if __name__ == "__main__":
    main()

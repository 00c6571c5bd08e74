#!/usr/bin/env python3
"""Runs eval sets through the PyTorch reference model and writes its answers for `kestrel eval --score-responses`.

    python3 reference/eval_ref.py --model CKPT_DIR --set passkey.jsonl [--set ...] [--limit N] --out ref.json
    build/src/cli/kestrel eval --set passkey.jsonl [--set ...] --score-responses ref.json

The engine and the reference are then judged by one scorer (src/evalclient/scorer.h), so their accuracies can be
set side by side (issue 8: "the engine must match its accuracy within sampling noise").

Each item's `request` is encoded with train/k3data/chat.py (`encode_chat`, byte-identical to the engine's chat
encoder), run through k3ref.Model in float32 (CUDA when available), prefilled in chunks of --chunk tokens so long
(64K) contexts fit in memory, then decoded greedily (argmax; the sets ask for temperature 0) until a stop token
(<|end_of_msg|>, [EOS], [EOT]) or the request's max_tokens, and parsed with chat.py's `parse_output` (a port of
the engine's output parser). A request with temperature > 0 is still decoded greedily, and says so on stderr.

Images (issue #21, the `image` task): each image_url part must be a PNG data URL of an image that the engine's
preprocess keeps as it is (sides multiples of 28, under the patch limits — the generated eval sets'
112 × 112); it is decoded by k3data.images.decode_png, cut into patches as the engine does, and run through
k3ref/vision.py (numpy, FP64 with BF16 roundings); the prompt is expanded as the engine expands it
(k3data.vision_gen.url_resolver) and the <|media_pad|> positions receive the rows (k3ref embed_override).

Output: {"format": "kestrel-eval-responses-v1", "source": ..., "items": [{"id", "response": {"finish_reason",
"content", "reasoning_content", "tool_calls": [{"name", "arguments"}]}} or {"id", "error"}]}. A failure of one item
(a request chat.py refuses, say) becomes its "error" and the run goes on.

CUDA: k3ref allocates with torch's factory functions and no device argument, so the default device is switched
before k3ref is imported and the checkpoint's tensors are moved once after loading.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_chat():
    """train/k3data/chat.py of this tree; K3DATA_DIR (the folder holding k3data/) overrides, for development."""
    for p in (os.environ.get("K3DATA_DIR"), str(ROOT / "train")):
        if p and (pathlib.Path(p) / "k3data" / "chat.py").exists():
            sys.path.insert(0, p)
            break
    try:
        from k3data import chat
    except ImportError as e:
        sys.exit(f"error: cannot import train/k3data/chat.py ({e}); set K3DATA_DIR to the folder holding k3data/")
    return chat


def load_items(paths, limit):
    items = []
    for path in paths:
        n = 0
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit and n >= limit:
                    break
                try:
                    it = json.loads(line)
                    assert isinstance(it, dict) and isinstance(it.get("id"), str) and isinstance(it.get("request"), dict)
                except (ValueError, AssertionError):
                    sys.exit(f"error: {path}:{lineno}: not an eval item (see docs/eval.md)")
                items.append(it)
                n += 1
    return items


def thinking_of(req) -> bool:
    if req.get("reasoning_effort") == "none":
        return False
    t = req.get("thinking")
    return True if t is None else bool(t)


class Runner:
    def __init__(self, model_dir, chat, device, chunk):
        import torch
        self.torch = torch
        self.device = device
        if device == "cuda":
            torch.set_default_device("cuda")
        sys.path.insert(0, str(ROOT / "reference"))
        from k3ref.model import Model
        self.model = Model(model_dir, dtype=torch.float32)
        if device == "cuda":
            ck = self.model.ck
            ck._raw = {k: v.to("cuda") for k, v in ck._raw.items()}
        self.chat = chat
        self.tok = chat.Tokenizer(model_dir)
        self.stops = set()
        for name in ("<|end_of_msg|>", "[EOS]", "[EOT]"):
            try:
                self.stops.add(self.tok.special(name))
            except (KeyError, ValueError):
                pass
        self.chunk = chunk
        self.model_dir = model_dir
        self.vision = None          # k3ref.vision.VisionWeights, loaded on the first image

    def image_rows(self, req: dict):
        """The projector rows of the request's images, in render order (None when it has none)."""
        from k3data import images, vision_gen
        parts = []
        for m in req.get("messages", []):
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                parts += [p for p in c if isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_image")]
        if not parts:
            return None, None
        from k3ref import vision
        if self.vision is None:
            self.vision = vision.VisionWeights(self.model_dir)
        enc = []
        for p in parts:
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            img = images.decode_png(images.png_from_data_url(url))
            x = images.patches(img)
            enc.append((x, img.shape[0] // images.PATCH, img.shape[1] // images.PATCH))
        return vision.encode(self.vision, enc), vision_gen.url_resolver

    def answer(self, req: dict, default_max_tokens: int) -> dict:
        torch = self.torch
        thinking = thinking_of(req)
        rows, resolver = self.image_rows(req)
        ids = self.chat.encode_chat(self.tok, req["messages"], tools=req.get("tools"),
                                    reasoning_effort=req.get("reasoning_effort"), thinking=thinking, images=resolver)
        pad_pos = []
        if rows is not None:
            pad = self.tok.special("<|media_pad|>")
            pad_pos = [i for i, t in enumerate(ids) if t == pad]
            if len(pad_pos) != rows.shape[0]:
                raise ValueError(f"{len(pad_pos)} <|media_pad|> positions but {rows.shape[0]} image rows")
        max_new = int(req.get("max_tokens") or req.get("max_completion_tokens") or default_max_tokens)
        with torch.inference_mode():
            st = self.model.new_state()
            logits = None
            used = 0
            for i in range(0, len(ids), self.chunk):
                here = [p - i for p in pad_pos if i <= p < i + self.chunk]
                over = None
                if here:
                    over = (here, torch.as_tensor(rows[used:used + len(here)], dtype=torch.float32))
                    used += len(here)
                logits = self.model.prefill(ids[i:i + self.chunk], st, embed_override=over)[-1]
            out, stopped = [], False
            while len(out) < max_new:
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                if nxt in self.stops:
                    stopped = True
                    break
                if len(out) < max_new:
                    logits = self.model.decode(nxt, st)
        names = [t["function"]["name"] for t in req.get("tools") or [] if isinstance(t, dict) and "function" in t]
        p = self.chat.parse_output(self.tok, out, thinking=thinking, known_tools=names, stopped=stopped)
        calls = []
        for c in p["tool_calls"]:
            e = {"name": c["name"], "arguments": c["arguments"]}
            if c.get("error"):
                e["problem"] = c["error"]
            calls.append(e)
        return {"finish_reason": p["finish_reason"], "content": p["content"],
                "reasoning_content": p["reasoning_content"], "tool_calls": calls}, len(ids), len(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (released format)")
    ap.add_argument("--set", action="append", required=True, help="eval-set JSONL (repeatable)")
    ap.add_argument("--out", required=True, help="responses JSON for `kestrel eval --score-responses`")
    ap.add_argument("--limit", type=int, default=0, help="only the first N items of each set")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk, tokens")
    ap.add_argument("--default-max-tokens", type=int, default=512, help="when a request sets no max_tokens")
    a = ap.parse_args(argv)
    if a.chunk < 1:
        ap.error("--chunk must be positive")
    chat = import_chat()
    sys.path.insert(0, str(ROOT / "reference"))
    import torch
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    items = load_items(a.set, a.limit)
    run = Runner(a.model, chat, device, a.chunk)
    out = []
    t0 = time.time()
    for n, it in enumerate(items, 1):
        req = it["request"]
        if req.get("temperature") not in (None, 0, 0.0):
            print(f"note: {it['id']}: temperature {req['temperature']} decoded greedily", file=sys.stderr)
        try:
            resp, plen, glen = run.answer(req, a.default_max_tokens)
            out.append({"id": it["id"], "response": resp})
            status = f"{plen} prompt + {glen} generated tokens, {resp['finish_reason']}"
        except Exception as e:  # one bad item must not end the run: it is reported as that item's error
            out.append({"id": it["id"], "error": f"{type(e).__name__}: {e}"})
            status = f"error: {e}"
        print(f"[{n}/{len(items)}] {it['id']}: {status} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    doc = {"format": "kestrel-eval-responses-v1", "source": "reference/eval_ref.py",
           "model": str(a.model), "device": device, "dtype": "float32", "decoding": "greedy",
           "sets": a.set, "limit": a.limit, "items": out}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{len(out)} responses written to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

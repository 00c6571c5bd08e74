"""Procedural image tasks for the small vision model (issue #21 point 5), as K3 chat conversations.

Five tasks, each a 112 × 112 RGB image (images.py draws it) and one question with a one-token-ish answer:

| task | image | question | answer |
|---|---|---|---|
| colour | one shape of a random kind, size and place | What colour is the shape? | red … brown (8 names) |
| shape | one shape of a random colour | What shape is in the image? | circle square triangle star diamond cross |
| count | 1–9 small shapes of one kind, colours mixed, each in its own cell of a 4 × 4 grid | How many shapes are there? | 1 … 9 |
| digits | a 1–4-digit number (0–9999), font scale 2 or 3, dark ink | What number is written in the image? | the number |
| word | a word of WORDS (3–8 letters), upper-case glyphs, scale 2 or 3 | What word is written in the image? | the word, lower case |

A conversation is `{"messages": [user: [image_url part, text part], assistant: answer], "image": uint8 [H,W,3],
"task", "answer"}`; the image_url part's URL is filled only when asked (`with_url=True`: the eval set; training
needs the pixels, not a PNG).  The assistant turn has an empty `reasoning_content` (thinking on, the think
block empty, as k3-tiny's small-talk turns are).  Sample i of the training stream uses seed i < 1,000,000 and
task i mod 5; the eval set uses seeds ≥ 1,000,000.  numpy only.
"""
from __future__ import annotations

import random

from . import images as im

TASKS = ("colour", "shape", "count", "digits", "word")
SIZE = 112                      # px; 8 × 8 patches, 16 image tokens
MAX_TOKENS = 96                 # the longest training conversation is 85 tokens; rows are padded to this

WORDS = ("cat", "dog", "sun", "map", "box", "cup", "key", "hat", "bus", "egg", "pen", "car", "fish", "bird",
         "tree", "book", "door", "lamp", "milk", "rain", "snow", "ship", "star", "moon", "road", "rock", "leaf",
         "frog", "bell", "coin", "desk", "fork", "gold", "hill", "kite", "lake", "nest", "ring", "sand", "wolf",
         "apple", "bread", "chair", "cloud", "dream", "field", "glass", "horse", "house", "juice", "lemon",
         "music", "night", "ocean", "paper", "plant", "queen", "river", "sheep", "stone", "table", "tiger",
         "train", "water", "whale", "zebra", "bridge", "candle", "castle", "circle", "garden", "island",
         "jacket", "ladder", "market", "monkey", "orange", "pencil", "rabbit", "rocket", "school", "silver",
         "spoon", "summer", "window", "winter", "yellow", "balloon", "blanket", "chicken", "cottage", "dolphin",
         "giraffe", "kitchen", "lantern", "morning", "pumpkin", "rainbow", "sandwich", "mountain", "elephant",
         "dinosaur", "umbrella", "keyboard", "airplane", "treasure", "notebook", "painting")

QUESTIONS = {
    "colour": ("What colour is the shape?", "What color is the shape in the image?", "Which colour is this shape?"),
    "shape": ("What shape is in the image?", "What shape is this?", "Name the shape in the picture."),
    "count": ("How many shapes are there?", "How many shapes are in the image?", "Count the shapes in the picture."),
    "digits": ("What number is written in the image?", "What number is this?", "Read the number in the picture."),
    "word": ("What word is written in the image?", "What word is this?", "Read the word in the picture."),
}


def _one_shape(r, img, kind, colour):
    rad = r.uniform(16, 40)
    cx, cy = r.uniform(rad + 2, SIZE - rad - 2), r.uniform(rad + 2, SIZE - rad - 2)
    rot = r.uniform(-0.25, 0.25)
    im.paint(img, im.shape_mask(SIZE, SIZE, kind, cx, cy, rad, rot), im.colour_rgb(r, colour))


def draw(task: str, r: random.Random):
    """-> (image uint8 [SIZE, SIZE, 3], answer str)."""
    img = im.background(r, SIZE, SIZE)
    if task == "colour":
        colour = r.choice(sorted(im.COLOURS))
        _one_shape(r, img, r.choice(im.SHAPES), colour)
        return img, colour
    if task == "shape":
        kind = r.choice(im.SHAPES)
        _one_shape(r, img, kind, r.choice(sorted(im.COLOURS)))
        return img, kind
    if task == "count":
        n = r.randint(1, 9)
        kind = r.choice(im.SHAPES)
        cell = SIZE // 4                                   # 28 px cells, one shape each
        for c in r.sample(range(16), n):
            rad = r.uniform(7, 11)
            cx = (c % 4) * cell + r.uniform(rad + 1, cell - rad - 1)
            cy = (c // 4) * cell + r.uniform(rad + 1, cell - rad - 1)
            im.paint(img, im.shape_mask(SIZE, SIZE, kind, cx, cy, rad, r.uniform(-0.25, 0.25)),
                     im.colour_rgb(r, r.choice(sorted(im.COLOURS))))
        return img, str(n)
    if task in ("digits", "word"):
        if task == "digits":
            nd = r.randint(1, 4)
            text = str(r.randint(0 if nd == 1 else 10 ** (nd - 1), 10 ** nd - 1))
        else:
            text = r.choice(WORDS)
        scale = r.choice([2, 3]) if len(text) <= 5 else 2
        m = im.text_mask(text, scale)
        h, w = m.shape
        x0, y0 = r.randint(1, SIZE - w - 1), r.randint(1, SIZE - h - 1)
        im.draw_text(img, text, scale, x0, y0, im.ink(r))
        return img, text.lower()
    raise ValueError(f"unknown image task {task!r}")


def conversation(seed: int, task: str | None = None, with_url: bool = False) -> dict:
    r = random.Random(seed * 104729 + 21)
    task = task or TASKS[seed % len(TASKS)]
    img, answer = draw(task, r)
    q = r.choice(QUESTIONS[task])
    part = {"type": "image_url", "image_url": {"url": im.data_url(img) if with_url else ""}}
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": q}]},
            {"role": "assistant", "reasoning_content": "", "content": answer}]
    return {"task": task, "messages": msgs, "image": img, "answer": answer}


def image_prompt(img):
    """The chat encoder's image resolver for one drawn image: (width, height, number of <|media_pad|>)."""
    h, w, _ = img.shape
    return w, h, im.num_image_tokens(w, h)


# ---------------------------------------------------------------------------------------------------------
# training rows and the eval set

_ENC_CACHE: dict = {}


def encode_sample(tok, conv):
    """-> (ids list, loss mask list): chat.encode_training with the image expanded as the engine expands it.
    Memoised on (question, answer, image size): the drawn pixels never enter the ids."""
    from . import chat
    h, w, _ = conv["image"].shape
    user = conv["messages"][0]["content"][1]["text"]
    key = (user, conv["answer"], w, h)
    hit = _ENC_CACHE.get(key)
    if hit is None:
        prompt = (w, h, im.num_image_tokens(w, h))
        hit = chat.encode_training(tok, conv["messages"], images=lambda part, i: prompt)
        if len(_ENC_CACHE) < 200_000:
            _ENC_CACHE[key] = hit
    return hit


EVAL_SEED0 = 1_000_000


def eval_items(per_task: int = 100, seed0: int = EVAL_SEED0, max_tokens: int = 32):
    """The image eval set (docs/eval.md, task "image"): per task `per_task` items, seeds seed0 + k·5 + t, t the
    task's index (every seed ≥ 1,000,000, never trained on), in seed order."""
    items = []
    for k in range(per_task):            # interleaved, so that `kestrel eval --limit N` covers every task
        for t, task in enumerate(TASKS):
            seed = seed0 + k * len(TASKS) + t
            conv = conversation(seed, task, with_url=True)
            items.append({"id": f"image-{task}-s{seed}", "task": "image",
                          "request": {"messages": conv["messages"][:1], "max_tokens": max_tokens},
                          "expect": {"answer": conv["answer"]}, "meta": {"kind": task}})
    return items


def url_resolver(part, index):
    """Image resolver for requests whose image parts are PNG data URLs (the eval set): the size from the PNG
    header, the token count from the engine's rule."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    png = im.png_from_data_url(url)
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return w, h, im.num_image_tokens(w, h)


def main(argv=None):
    import argparse
    import json
    import os
    ap = argparse.ArgumentParser(description="write the image eval set (JSONL)")
    ap.add_argument("--out", required=True, help="directory; writes image.jsonl there")
    ap.add_argument("--per-task", type=int, default=100)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "image.jsonl")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for it in eval_items(a.per_task):
            f.write(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The image tasks of k3-tiny-vl (issue #21 point 5), torch-free: the drawing (checked from the pixels, not from
the drawing code), the PNG writer, the chat encoder's image expansion against `kestrel tokenize --chat`, the
training rows, the committed eval set, and the checkpoint assembly (export_vl) with `kestrel inspect`."""
import json
import os
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "train"))

from k3data import chat, images, vision_gen  # noqa: E402
from k3train import export_vl  # noqa: E402  (torch-free module)

VOCAB = os.path.join(ROOT, "tests", "data", "tok_golden")
BIN = os.environ.get("KESTREL_BIN", os.path.join(ROOT, "build", "src", "cli", "kestrel"))
EVAL = os.path.join(ROOT, "models", "k3-tiny-vl", "eval", "image.jsonl")
TINY = os.path.join(ROOT, "models", "k3-tiny")


@pytest.fixture(scope="module")
def tok():
    return chat.Tokenizer(VOCAB)


def components(mask):
    """Number of 8-connected components of a bool image (plain flood fill; a star's thin tip may touch the
    rest only at a corner)."""
    seen = np.zeros_like(mask)
    n = 0
    h, w = mask.shape
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        n += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for yy, xx in ((y + dy, x + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)):
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
    return n


def foreground(img):
    """Pixels that differ from the background (the corner pixel: every drawing keeps a margin)."""
    bg = Counter(map(tuple, img[[0, 0, -1, -1], [0, -1, 0, -1]])).most_common(1)[0][0]
    return np.any(img != np.array(bg, dtype=np.uint8), axis=-1)


def test_font_glyphs_are_distinct():
    seen = {}
    for c, g in images.FONT.items():
        assert g.shape == (images.GLYPH_H, images.GLYPH_W) and g.any(), c
        key = g.tobytes()
        assert key not in seen, (c, seen.get(key))
        seen[key] = c
    assert set(images.FONT) == set("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def test_png_round_trip_and_header():
    r = np.random.default_rng(1).integers(0, 256, size=(28, 56, 3), dtype=np.uint8)
    png = images.encode_png(r)
    assert np.array_equal(images.decode_png(png), r)
    assert struct.unpack(">II", png[16:24]) == (56, 28)
    url = images.data_url(r)
    assert images.png_from_data_url(url) == png


def test_tasks_draw_what_they_answer():
    for seed in range(20):
        for task in vision_gen.TASKS:
            a = vision_gen.conversation(seed, task)
            b = vision_gen.conversation(seed, task)
            assert np.array_equal(a["image"], b["image"]) and a["answer"] == b["answer"]   # a seed is an image
            img, ans = a["image"], a["answer"]
            assert img.shape == (vision_gen.SIZE, vision_gen.SIZE, 3)
            fg = foreground(img)
            assert fg.sum() > 20, (seed, task)
            if task == "colour":
                mean = img[fg].astype(float).mean(0)
                dist = {n: np.abs(mean - np.array(c)).sum() for n, c in images.COLOURS.items()}
                assert min(dist, key=dist.get) == ans, (seed, mean, ans)
            elif task == "shape":
                assert ans in images.SHAPES and components(fg) == 1, (seed, ans)
            elif task == "count":
                assert components(fg) == int(ans), (seed, ans)
            elif task == "digits":
                assert ans.isdigit() and 1 <= len(ans) <= 4 and str(int(ans)) == ans
            else:
                assert ans in vision_gen.WORDS


def kestrel_chat(req):
    out = subprocess.run([BIN, "tokenize", "--model", VOCAB, "--chat"], input=json.dumps(req).encode(),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    prompt, ids = out.stdout.decode().rstrip("\n").rsplit("\n", 1)
    return prompt, [int(x) for x in ids.split()]


def test_image_expansion_matches_engine(tok):
    reqs = [it["request"] for it in vision_gen.eval_items(per_task=1)]
    odd = [np.full((90, 200, 3), 90, np.uint8), np.zeros((30, 3000, 3), np.uint8), np.zeros((1000, 1300, 3), np.uint8)]
    reqs.append({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": images.data_url(odd[0])}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": images.data_url(odd[1])}}]},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": images.data_url(odd[2])}}]}],
        "reasoning_effort": "low"})
    for req in reqs:
        prompt, ids = kestrel_chat(req)
        assert chat.render_text(req, images=vision_gen.url_resolver) == prompt
        assert chat.encode_request(tok, req, images=vision_gen.url_resolver) == ids
    assert images.num_image_tokens(112, 112) == 16


def test_training_rows(tok):
    pad = tok.special("<|media_pad|>")
    for seed in range(40):
        conv = vision_gen.conversation(seed)
        ids, mask = vision_gen.encode_sample(tok, conv)
        assert len(ids) == len(mask) <= vision_gen.MAX_TOKENS
        assert ids.count(pad) == 16
        target = [i for i, m in zip(ids, mask) if m]
        assert target == chat.encode_completion(tok, conv["messages"][1])
        # the prompt part is what the engine gets for the request
        prompt = chat.encode_chat(tok, conv["messages"][:1], images=lambda p, i: vision_gen.image_prompt(conv["image"]))
        assert ids[:len(prompt)] == prompt
    longest = max((w for w in vision_gen.WORDS), key=len)
    conv = vision_gen.conversation(0, "word")
    conv["messages"][1]["content"] = conv["answer"] = longest
    conv["messages"][0]["content"][1]["text"] = max(vision_gen.QUESTIONS["word"], key=len)
    assert len(vision_gen.encode_sample(tok, conv)[0]) <= vision_gen.MAX_TOKENS


def test_committed_eval_set():
    with open(EVAL) as f:
        lines = f.read().splitlines()
    fresh = [json.dumps(it, ensure_ascii=False, sort_keys=True) for it in vision_gen.eval_items(100)]
    assert lines == fresh
    items = [json.loads(x) for x in lines]
    kinds = Counter(it["meta"]["kind"] for it in items)
    assert kinds == {t: 100 for t in vision_gen.TASKS}
    seeds = [int(it["id"].rsplit("-s", 1)[1]) for it in items]
    assert min(seeds) >= 1_000_000 and len(set(seeds)) == len(seeds)


def test_export_vl_assembles_and_engine_inspects(tmp_path):
    # k3-tiny ships in the repository: its absence is a broken checkout, not a reason to skip.
    assert os.path.exists(os.path.join(TINY, "config.json")), f"{TINY} missing"
    sys.path.insert(0, os.path.join(ROOT, "reference"))
    import make_checkpoint
    vc = dict(make_checkpoint.VISION_NANO, text_hidden_size=256)
    names = {"vision_tower.patch_embed.proj.weight": (32, 3, 14, 14), "vision_tower.patch_embed.pos_emb.weight": (8, 8, 32),
             "vision_tower.encoder.final_layernorm.weight": (32,), "mm_projector.proj.0.weight": (128, 128),
             "mm_projector.proj.2.weight": (256, 128), "mm_projector.post_norm.weight": (256,)}
    for b in range(2):
        B = f"vision_tower.encoder.blocks.{b}."
        names.update({B + "norm0.weight": (32,), B + "norm1.weight": (32,), B + "wqkv.weight": (96, 32),
                      B + "wo.weight": (32, 32), B + "mlp.fc0.weight": (64, 32), B + "mlp.fc1.weight": (32, 64)})
    rng = np.random.default_rng(0)
    t = {}
    for n, s in names.items():
        v = (rng.standard_normal(s) * 0.05).astype(np.float32)
        t[n] = ("BF16", s, (v.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    vpath = tmp_path / "vision.safetensors"
    export_vl.write_safetensors(str(vpath), t, {"vision_config": json.dumps(vc), "k3train_vl_state": "{}"})
    out = tmp_path / "vl"
    export_vl.assemble(TINY, str(vpath), str(out))
    cfg = json.load(open(out / "config.json"))
    assert cfg["vision_config"]["vt_hidden_size"] == 32 and cfg["text_config"] == json.load(open(os.path.join(TINY, "config.json")))["text_config"]
    idx = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    old = json.load(open(os.path.join(TINY, "model.safetensors.index.json")))["weight_map"]
    assert set(idx) == set(old) | set(names)
    for name in list(old)[::50]:                       # text tensors: the same bytes
        a, _ = export_vl.read_tensors(os.path.join(TINY, old[name]))
        b, _ = export_vl.read_tensors(str(out / idx[name]))
        assert a[name] == b[name]
    r = subprocess.run([BIN, "inspect", str(out)], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert b"vision" in r.stdout.lower()


def test_train_vl_task_weights_keep_the_default_stream_and_weight_tasks():
    pytest.importorskip("torch")
    from k3train import train_vl
    assert train_vl.task_cycle("") == vision_gen.TASKS          # default: the five tasks in turn, as before
    c = train_vl.task_cycle("digits=3,word=2,colour=0")
    assert Counter(c) == {"shape": 1, "count": 1, "digits": 3, "word": 2}
    for bad in ("digit=2", "word=x", "colour=0,shape=0,count=0,digits=0,word=0"):
        with pytest.raises(SystemExit):
            train_vl.task_cycle(bad)

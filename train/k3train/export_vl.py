"""Assemble k3-tiny-vl in the released layout: k3-tiny's text shards copied byte for byte, plus one shard with the
trained vision tower and projector (train_vl.py's vision.safetensors), config.json = k3-tiny's + vision_config.

    python3 -m k3train.export_vl --text-model ../models/k3-tiny --vision OUT/vision.safetensors \
        --out ../models/k3-tiny-vl

torch-free (numpy + json + struct): the vision file is re-written tensor by tensor with its bytes unchanged
(BF16, released names), so this runs anywhere the repository's tests run.  The text shards are renamed
model-0000i-of-0000N (N = text shards + 1) — copies, or with --link-text relative symlinks to k3-tiny's files
— and the index rebuilt; every text tensor's bytes are unchanged
(tests/py/test_k3data_images.py checks it on the committed model when present).  Tokenizer files and the
model card (README.md, written by hand) are not generated here; the tokenizer files are copied.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct

SHARD_LIMIT = 15 * 1024 * 1024


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> (dtype str, shape list, bytes); names sorted, 8-byte aligned header as safetensors does."""
    header, off = {}, 0
    for name in sorted(tensors):
        dt, shape, data = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def read_tensors(path):
    header, base = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            b0, b1 = meta["data_offsets"]
            f.seek(base + b0)
            out[name] = (meta["dtype"], meta["shape"], f.read(b1 - b0))
    return out, header.get("__metadata__", {})


def assemble(text_dir, vision_path, out, link_text=False):
    with open(os.path.join(text_dir, "config.json")) as f:
        cfg = json.load(f)
    if "vision_config" in cfg:
        raise ValueError(f"{text_dir} already has a vision tower")
    vt, meta = read_tensors(vision_path)
    vc = json.loads(meta["vision_config"])
    if vc["text_hidden_size"] != cfg["text_config"]["hidden_size"]:
        raise ValueError("vision_config.text_hidden_size differs from the text model's hidden_size")
    bad = [n for n, (dt, _, _) in vt.items() if dt != "BF16" or not n.startswith(("vision_tower.", "mm_projector."))]
    if bad:
        raise ValueError(f"unexpected tensors in {vision_path}: {bad[:3]}")
    size = sum(len(t[2]) for t in vt.values())
    if size > SHARD_LIMIT:
        raise ValueError(f"vision tensors take {size:,} bytes > one {SHARD_LIMIT:,}-byte shard")
    with open(os.path.join(text_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    text_shards = sorted(set(index["weight_map"].values()))
    n = len(text_shards) + 1
    os.makedirs(out, exist_ok=True)
    for fn in os.listdir(out):
        if fn.endswith(".safetensors"):
            os.remove(os.path.join(out, fn))     # (a symlink is removed, not its target)
    rename, wmap = {}, {}
    for i, fn in enumerate(text_shards):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        if link_text:   # a relative symlink: the repository then holds k3-tiny's shards once
            os.symlink(os.path.relpath(os.path.join(text_dir, fn), out), os.path.join(out, new))
        else:
            shutil.copyfile(os.path.join(text_dir, fn), os.path.join(out, new))
        rename[fn] = new
    for name, fn in index["weight_map"].items():
        wmap[name] = rename[fn]
    vfn = f"model-{n:05d}-of-{n:05d}.safetensors"
    write_safetensors(os.path.join(out, vfn), vt, {"format": "pt"})
    wmap.update({name: vfn for name in vt})
    total = index.get("metadata", {}).get("total_size", 0) + size
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1, sort_keys=True)
        f.write("\n")
    cfg["vision_config"] = vc
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    for fn in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(text_dir, fn), os.path.join(out, fn))
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text-model", required=True)
    ap.add_argument("--vision", required=True, help="vision.safetensors from k3train.train_vl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--link-text", action="store_true",
                    help="text shards as relative symlinks to --text-model's files instead of copies")
    a = ap.parse_args(argv)
    total = assemble(a.text_model, a.vision, a.out, a.link_text)
    print(f"wrote {a.out}: {total:,} bytes of tensors")


if __name__ == "__main__":
    main()

"""Image input end to end (issue #21, the front end): `kestrel serve` on the nano checkpoint (which has a
vision_config) and on a `--no-vision` one, driven by the official openai client and raw HTTP; and
`kestrel generate --image`. Test pictures: PNGs written here (zlib + struct), and the tiny PNG/JPEG/WebP
files of the fuzz seed corpus (tests/fuzz/corpus/fuzz_image/, made with libpng/libjpeg/libwebp).

Which tests need the vision engine (the other half of #21) to mean what they say: test_image_request_is_
answered_and_counted and test_responses_input_image pass in this branch because the engine does not
read Request::images yet; once the vision tower consumes them they check the real path."""
import base64
import json
import pathlib
import struct
import zlib

import httpx
import openai
import pytest

from conftest import ROOT, run_kestrel
from serve_util import Server

MODEL = "nano"
CORPUS = ROOT / "tests" / "fuzz" / "corpus" / "fuzz_image"


def png(w, h, pixel=lambda x, y: (x * 37 % 256, y * 91 % 256, 128)):
    """An 8-bit RGB PNG."""
    raw = b"".join(b"\0" + bytes(c for x in range(w) for c in pixel(x, y)) for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def png_claiming(w, h):
    """A 1x1 PNG whose header claims w x h (a decompression bomb's header, CRC fixed)."""
    b = bytearray(png(1, 1))
    b[16:24] = struct.pack(">II", w, h)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])))
    return bytes(b)


def data_url(b, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(b).decode()


def user(*images, text="What is in the picture?"):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return [{"role": "user", "content": parts}]


def tokens(w, h):
    """<|media_pad|> tokens of a w x h image (MODEL.md §6: no resize below the limits; pad to 28)."""
    return ((w + 27) // 28) * ((h + 27) // 28)


@pytest.fixture(scope="module")
def server(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "4",
               "--block-size", "16", "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "1000000",
               "--allowed-local-media-path", CORPUS)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pad_id(nano_dir):
    return json.loads((pathlib.Path(nano_dir) / "config.json").read_text())["media_placeholder_token_id"]


def refused(server, messages, **extra):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": messages, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err["message"]


def no_vision_copy(nano_dir, out):
    """nano's config.json without vision_config (what `make_checkpoint.py --no-vision` writes) and its
    tokenizer, for the fake engine (config only, no weights: quick to start)."""
    out.mkdir()
    for f in pathlib.Path(nano_dir).iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors") and f.is_file():
            (out / f.name).symlink_to(f)
    cfg = json.loads((pathlib.Path(nano_dir) / "config.json").read_text())
    cfg.pop("vision_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_no_vision_checkpoint_refuses_images(kestrel_bin, nano_dir, tmp_path):
    s = Server(kestrel_bin, no_vision_copy(nano_dir, tmp_path / "novision"), "--fake-engine",
               "--served-model-name", MODEL, "--max-model-len", "1024")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=user(data_url(png(28, 28))), max_tokens=2)
        assert "no vision tower" in str(e.value)
        r = httpx.post(s.url + "/tokenize", json={"messages": user(data_url(png(28, 28)))})
        assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
        # Text still works.
        assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        assert s.stop() == 0


def test_image_request_is_answered_and_counted(server, client, pad_id):
    """Needs the vision engine to be meaningful (see the module docstring)."""
    for name in ("rgb_5x3.png", "rgba_4x4.png", "rgb_16x8.jpg", "prog_16x16.jpg", "rgb_16x8.webp", "rgba_4x4.webp"):
        b = (CORPUS / name).read_bytes()
        r = client.chat.completions.create(model=MODEL, messages=user(data_url(b)), max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop"), name
        t = httpx.post(server.url + "/tokenize", json={"messages": user(data_url(b))}).json()
        assert r.usage.prompt_tokens == t["count"], name  # usage counts the image tokens
        assert t["tokens"].count(pad_id) == 1, name       # a tiny image is one 28 x 28 padded grid: 1 token


def test_tokenize_counts_image_tokens(server, pad_id):
    text_only = httpx.post(server.url + "/tokenize", json={"messages": user()}).json()["count"]
    for w, h in ((100, 50), (28, 28), (57, 200)):
        r = httpx.post(server.url + "/tokenize", json={"messages": user(data_url(png(w, h)))}).json()
        assert r["tokens"].count(pad_id) == tokens(w, h), (w, h)
        assert r["count"] > text_only + tokens(w, h)  # the pads plus <|media_begin|>image WxH<|media_content|>...
    two = httpx.post(server.url + "/tokenize", json={"messages": user(data_url(png(100, 50)), data_url(png(28, 28)))})
    assert two.json()["tokens"].count(pad_id) == tokens(100, 50) + 1


def test_repeated_image_hits_the_prefix_cache_and_another_does_not(server, client, pad_id):
    # A 112 x 112 image is 16 pad tokens; blocks are 16 tokens. The same image again reuses every full
    # block; another image of the same size (same prompt text, same "image 112x112") only those before its pads.
    a = data_url(png(112, 112))
    b = data_url(png(112, 112, lambda x, y: (255 - x, y, 7)))
    msgs = user(a, text="Describe this image in detail, please, with many words.")
    ids = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    first_pad, n = ids.index(pad_id), ids.count(pad_id)
    assert n == 16

    def cached(messages):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens, (r.usage.prompt_tokens_details.cached_tokens or 0)
    p0, c0 = cached(msgs)
    p1, c1 = cached(msgs)
    p2, c2 = cached(user(b, text="Describe this image in detail, please, with many words."))
    assert p0 == p1 == p2 == len(ids)
    assert c1 >= (first_pad + n) // 16 * 16 and c1 > c0, (c0, c1, first_pad)
    assert c2 <= first_pad // 16 * 16, (c2, first_pad)


def test_bad_images_are_400(server):
    good = png(28, 28)
    cases = {
        "invalid base64": user("data:image/png;base64,iVBOR%%%"),
        "only base64 data: URLs": user("data:image/png," + good.hex()),
        "not fetched": user("https://example.com/cat.png"),
        "not a PNG, JPEG or WebP": user(data_url(b"hello world, no picture here")),
        "unsupported image format GIF": user(data_url(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "image/gif")),
        "corrupt or truncated PNG": user(data_url(good[:len(good) // 2])),
        "exceeds the limit of 1000000 pixels": user(data_url(png_claiming(100000, 100000))),
        "more than 2 images": user(*[data_url(good)] * 3),
        "detail 'low' is not supported": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(good), "detail": "low"}}]}],
        "needs image_url.url": [{"role": "user", "content": [{"type": "image_url"}]}],
    }
    corrupt = bytearray(good)
    corrupt[45] ^= 0xFF  # inside IDAT: its CRC no longer matches
    cases["PNG"] = user(data_url(bytes(corrupt)))
    for want, msgs in cases.items():
        msg = refused(server, msgs)
        assert want in msg, (want, msg)
    # The server is unharmed: a good request still works.
    assert httpx.post(server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": user(data_url(good)), "max_tokens": 2}).status_code == 200


def test_local_files_only_under_the_allowed_path(server, tmp_path):
    inside = CORPUS / "rgb_5x3.png"
    assert httpx.post(server.url + "/tokenize", json={"messages": user("file://" + str(inside))}).status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"messages": user("rgb_16x8.jpg")}).status_code == 200
    outside = tmp_path / "x.png"
    outside.write_bytes(png(28, 28))
    for url in ("file://" + str(outside), str(CORPUS / ".." / "fuzz_chat_request"), "../../../../../etc/passwd"):
        msg = refused(server, user(url))
        assert "not a file under the allowed local media path" in msg, (url, msg)


def test_local_files_refused_without_the_flag(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--fake-engine", "--served-model-name", MODEL, "--max-model-len", "1024",
               "--max-image-bytes-per-request", "2000")
    try:
        assert "--allowed-local-media-path" in refused(s, user("file://" + str(CORPUS / "rgb_5x3.png")))
        assert "exceed 2000 bytes" in refused(s, user(data_url(png(100, 100, lambda x, y: (x * y % 256, x, y)))))
    finally:
        assert s.stop() == 0


def test_responses_input_image(server, client):
    """Needs the vision engine to be meaningful (see the module docstring)."""
    r = client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": data_url(png(56, 28))}]}])
    assert r.status == "completed" or r.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://example.com/a.png"}]}])
    assert "not fetched" in str(e.value)


def test_generate_with_images(kestrel_bin, nano_dir, pad_id, tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(png(56, 28))  # 2 tokens
    ok = run_kestrel(kestrel_bin, "generate", "--model", nano_dir, "--prompt-tokens", f"5,{pad_id},{pad_id},9",
                     "--image", img, "--max-tokens", "2", "--dump-logits", tmp_path / "l.npy")
    assert ok.returncode == 0, ok.stderr
    assert "image 0: prompt positions [1, 3)" in ok.stdout
    assert "logits: 5 positions" in ok.stdout
    bad = run_kestrel(kestrel_bin, "generate", "--model", nano_dir, "--prompt-tokens", f"5,{pad_id},9",
                      "--image", img, "--max-tokens", "2")
    assert bad.returncode == 1 and "1 <|media_pad|> tokens" in bad.stderr and "need 2" in bad.stderr, bad.stderr
    split = run_kestrel(kestrel_bin, "generate", "--model", nano_dir, "--prompt-tokens", f"5,{pad_id},9,{pad_id}",
                        "--image", img, "--max-tokens", "2")
    assert split.returncode == 1 and "not consecutive" in split.stderr, split.stderr
    corrupt = tmp_path / "c.png"
    corrupt.write_bytes(png(56, 28)[:40])
    c = run_kestrel(kestrel_bin, "generate", "--model", nano_dir, "--prompt-tokens", f"{pad_id},{pad_id}",
                    "--image", corrupt, "--max-tokens", "2")
    assert c.returncode == 1 and "c.png" in c.stderr and "PNG" in c.stderr, c.stderr

"""Procedural images for the small vision model (issue #21 point 5), numpy only: drawing, a 5 × 7 bitmap font of
our own, a PNG writer, the engine's preprocess geometry and patches.

Drawing is on a uint8 [H, W, 3] canvas with hard edges (no anti-aliasing): shapes are point-in-region tests of
pixel centres (x + 0.5, y + 0.5), polygons by the even-odd crossing rule; text is the font below scaled by an
integer factor.  Everything is a pure function of a `random.Random`, so a seed gives the same image anywhere.

PNG: 8-bit RGB, one IDAT, filter 0 on every row, zlib level 9 — lossless, so the engine (libpng) decodes
exactly these pixels.  Preprocess: `plan_resize` is src/vision/image.cpp's rule (never enlarges; pads to
multiples of merge·patch); the generated images are 112 × 112, which that rule keeps as they are (8 × 8
patches of 14 px → 16 image tokens after the 2 × 2 merge), so `patches` needs no resampler.
"""
from __future__ import annotations

import base64
import functools
import math
import struct
import zlib

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# font: 5 columns × 7 rows per glyph, '#' = ink (our own drawing of the usual 5 × 7 dot-matrix letter forms)
_GLYPHS = {
    "0": [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    "1": ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "2": [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    "3": ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    "4": ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    "5": ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    "6": ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    "7": ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    "8": [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    "9": [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
    "A": [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "B": ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "],
    "C": [" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "],
    "D": ["###  ", "#  # ", "#   #", "#   #", "#   #", "#  # ", "###  "],
    "E": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
    "F": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "],
    "G": [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"],
    "H": ["#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "I": [" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "J": ["  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "],
    "K": ["#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"],
    "L": ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"],
    "M": ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"],
    "N": ["#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"],
    "O": [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "P": ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "],
    "Q": [" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"],
    "R": ["#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"],
    "S": [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "],
    "T": ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "],
    "U": ["#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "V": ["#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "],
    "W": ["#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "],
    "X": ["#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"],
    "Y": ["#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "],
    "Z": ["#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"],
}
GLYPH_W, GLYPH_H = 5, 7
FONT = {c: np.array([[ch == "#" for ch in row] for row in rows], dtype=bool) for c, rows in _GLYPHS.items()}


def text_mask(text: str, scale: int, gap: int = 1) -> np.ndarray:
    """bool [7·scale, n·5·scale + (n−1)·gap·scale]: the glyphs of `text` (upper-cased), `gap` font pixels apart."""
    cols = []
    for i, ch in enumerate(text.upper()):
        if i:
            cols.append(np.zeros((GLYPH_H, gap), dtype=bool))
        cols.append(FONT[ch])
    m = np.concatenate(cols, axis=1)
    return np.repeat(np.repeat(m, scale, axis=0), scale, axis=1)


# ---------------------------------------------------------------------------------------------------------
# shapes


@functools.lru_cache(maxsize=8)
def _grid(h, w):
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    x, y = x + 0.5, y + 0.5
    x.flags.writeable = y.flags.writeable = False
    return x, y


def _polygon(x, y, pts) -> np.ndarray:
    """Even-odd fill of the polygon pts [(x, y), ...] over the pixel centres x, y."""
    inside = np.zeros(x.shape, dtype=bool)
    n = len(pts)
    for i in range(n):
        x0, y0 = pts[i]
        x1, y1 = pts[(i + 1) % n]
        if y0 == y1:
            continue
        cross = (y0 > y) != (y1 > y)
        xi = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        inside ^= cross & (x < xi)
    return inside


def polygon_mask(h, w, pts) -> np.ndarray:
    x, y = _grid(h, w)
    return _polygon(x, y, pts)


SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")


def _shape(x, y, kind, cx, cy, r, rot):
    if kind == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if kind == "square":
        s = 0.8 * r
        return (np.abs(x - cx) <= s) & (np.abs(y - cy) <= s)
    if kind == "diamond":
        return np.abs(x - cx) + np.abs(y - cy) <= r
    if kind == "cross":
        t = 0.33 * r
        return (((np.abs(x - cx) <= r) & (np.abs(y - cy) <= t)) | ((np.abs(x - cx) <= t) & (np.abs(y - cy) <= r)))
    if kind == "triangle":
        pts = [(cx + r * math.sin(rot + k * 2 * math.pi / 3), cy - r * math.cos(rot + k * 2 * math.pi / 3))
               for k in range(3)]
        return _polygon(x, y, pts)
    if kind == "star":
        pts = []
        for k in range(10):
            rr = r if k % 2 == 0 else 0.42 * r
            a = rot + k * math.pi / 5
            pts.append((cx + rr * math.sin(a), cy - rr * math.cos(a)))
        return _polygon(x, y, pts)
    raise ValueError(f"unknown shape {kind!r}")


def shape_mask(h, w, kind, cx, cy, r, rot=0.0) -> np.ndarray:
    """The region (bool [h, w]) of one shape of 'radius' r (half its extent) centred at (cx, cy); rot (radians)
    turns the triangle and the star only (a turned square would be a diamond).  Every shape lies inside the
    disc of radius r, so only that box is evaluated."""
    x, y = _grid(h, w)
    y0, y1 = max(0, int(math.floor(cy - r)) - 1), min(h, int(math.ceil(cy + r)) + 1)
    x0, x1 = max(0, int(math.floor(cx - r)) - 1), min(w, int(math.ceil(cx + r)) + 1)
    out = np.zeros((h, w), dtype=bool)
    if y0 < y1 and x0 < x1:
        out[y0:y1, x0:x1] = _shape(x[y0:y1, x0:x1], y[y0:y1, x0:x1], kind, cx, cy, r, rot)
    return out


# ---------------------------------------------------------------------------------------------------------
# colours: name -> RGB centre; drawn with ±jitter per channel

COLOURS = {
    "red": (215, 30, 35), "green": (35, 160, 50), "blue": (35, 70, 215), "yellow": (240, 215, 25),
    "orange": (245, 135, 20), "purple": (135, 45, 175), "pink": (245, 125, 185), "brown": (125, 75, 30),
}


def colour_rgb(r, name, jitter=18) -> np.ndarray:
    c = np.array(COLOURS[name], dtype=np.int64) + np.array([r.randint(-jitter, jitter) for _ in range(3)])
    return np.clip(c, 0, 255).astype(np.uint8)


def background(r, h, w) -> np.ndarray:
    """A light, nearly neutral background (grey 205–255 with a slight tint)."""
    g = r.randint(205, 255)
    c = np.clip(np.array([g + r.randint(-8, 8) for _ in range(3)]), 0, 255).astype(np.uint8)
    return np.broadcast_to(c, (h, w, 3)).copy()


def ink(r) -> np.ndarray:
    """A dark text colour: near black or a dark hue."""
    return np.array([r.randint(0, 90), r.randint(0, 90), r.randint(0, 90)], dtype=np.uint8)


def paint(img: np.ndarray, mask: np.ndarray, rgb) -> None:
    img[mask] = np.asarray(rgb, dtype=np.uint8)


def draw_text(img: np.ndarray, text: str, scale: int, x0: int, y0: int, rgb) -> None:
    m = text_mask(text, scale)
    h, w = m.shape
    if y0 < 0 or x0 < 0 or y0 + h > img.shape[0] or x0 + w > img.shape[1]:
        raise ValueError(f"text {text!r} at ({x0}, {y0}) scale {scale} leaves the {img.shape[1]}x{img.shape[0]} image")
    region = img[y0:y0 + h, x0:x0 + w]
    region[m] = np.asarray(rgb, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------------
# PNG (8-bit RGB, filter 0, one IDAT)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(img: np.ndarray) -> bytes:
    img = np.ascontiguousarray(img, dtype=np.uint8)
    h, w, c = img.shape
    if c != 3:
        raise ValueError("encode_png wants RGB [H, W, 3]")
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def decode_png(data: bytes) -> np.ndarray:
    """The inverse of encode_png, for the PNGs it writes and any 8-bit RGB non-interlaced PNG whose rows use
    filter 0 (None) or 1 (Sub); anything else is refused (the engine decodes with libpng; this is for tests and
    the reference's eval path, which only ever read encode_png's output)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        n = struct.unpack(">I", data[pos:pos + 4])[0]
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if tag == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat += body
        elif tag == b"IEND":
            break
    if hdr is None or hdr[2:] != (8, 2, 0, 0, 0):
        raise ValueError(f"unsupported PNG header {hdr}")
    w, h = hdr[0], hdr[1]
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + w * 3)
    out = raw[:, 1:].copy()
    for y in range(h):
        f = raw[y, 0]
        if f == 1:
            row = out[y].reshape(w, 3).astype(np.uint16)
            for x in range(1, w):
                row[x] = (row[x] + row[x - 1]) & 0xFF
            out[y] = row.reshape(-1).astype(np.uint8)
        elif f != 0:
            raise ValueError(f"PNG row filter {f} not supported here")
    return out.reshape(h, w, 3)


def data_url(img: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(encode_png(img)).decode("ascii")


def png_from_data_url(url: str) -> bytes:
    head, _, body = url.partition(",")
    if not head.startswith("data:image/png;base64"):
        raise ValueError("not a base64 PNG data URL")
    return base64.b64decode(body)


# ---------------------------------------------------------------------------------------------------------
# preprocess geometry and patches (src/vision/image.h)

PATCH, MERGE, IN_PATCH_LIMIT, SIDE_LIMIT = 14, 2, 16384, 512


def plan_resize(width: int, height: int, patch=PATCH, merge=MERGE, in_patch_limit=IN_PATCH_LIMIT,
                side_patches=SIDE_LIMIT):
    """-> (resized_w, resized_h, grid_w, grid_h), the engine's rule."""
    side = side_patches * patch
    s1 = math.sqrt(in_patch_limit / (max(1.0, float(width // patch)) * max(1.0, float(height // patch))))
    scale = min(1.0, s1, side / width, side / height)
    rw = min(max(1, int(width * scale)), side)
    rh = min(max(1, int(height * scale)), side)
    f = merge * patch
    return rw, rh, (rw + f - 1) // f * merge, (rh + f - 1) // f * merge


def num_image_tokens(width: int, height: int) -> int:
    _, _, gw, gh = plan_resize(width, height)
    return (gh // 2) * (gw // 2)


def patches(img: np.ndarray, patch=PATCH) -> np.ndarray:
    """uint8 [H, W, 3] with H, W multiples of 2·patch and no resize needed -> f32 [gh·gw, 3·p·p]: (v/255 − 0.5)/0.5 in
    float32 as the engine computes it, grid row-major, (c, y, x) inside a patch."""
    h, w, _ = img.shape
    rw, rh, gw, gh = plan_resize(w, h, patch)
    if (rw, rh) != (w, h) or gw * patch != w or gh * patch != h:
        raise ValueError(f"{w}x{h} needs a resize or padding; the generator only makes images that need neither")
    v = (img.astype(np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)     # [H, W, 3]
    v = v.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 4, 1, 3)                        # [gh, gw, c, y, x]
    return np.ascontiguousarray(v.reshape(gh * gw, 3 * patch * patch))

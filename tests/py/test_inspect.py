"""`kestrel inspect`: correct numbers on nano / mini / full, and a specific error with a non-zero
exit for every kind of corrupted checkpoint or config.

Corruptions are made by rewriting safetensors headers directly (8-byte little-endian length, JSON,
data), so these tests depend only on the file format, not on the generator's internals.
"""
import json
import pathlib
import struct

import pytest

from conftest import ROOT, run_kestrel, make_checkpoint

FULL_CONFIG = ROOT / "tests" / "data" / "k31_pro_config.json"


# ---------------------------------------------------------------------------------------------
# helpers for editing shards
def read_st(path):
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path, header, data):
    h = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(h)) + h + data)


def index_of(ckpt):
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def shard_with(ckpt, tensor):
    return ckpt / index_of(ckpt)["weight_map"][tensor]


NORM = "language_model.model.norm.weight"             # bf16 [256] in nano
EMBED = "language_model.model.embed_tokens.weight"     # bf16 [1024, 256]


def expect_failure(kestrel_bin, ckpt, *fragments):
    r = run_kestrel(kestrel_bin, "inspect", ckpt)
    assert r.returncode != 0, f"inspect accepted a corrupted checkpoint:\n{r.stdout}"
    assert r.returncode == 1, f"expected a clean error exit, got {r.returncode}:\n{r.stderr}"
    assert r.stderr.startswith("error: "), r.stderr
    for f in fragments:
        assert f in r.stderr, f"missing {f!r} in:\n{r.stderr}"
    return r.stderr


# ---------------------------------------------------------------------------------------------
# correct numbers
def nano_param_count():
    """Independent count of the nano text model from MODEL.md Appendix A and §2."""
    D, V = 256, 1024
    H, Dk, W = 4, 32, 4
    kda = 4 * H * Dk * D + 3 * H * Dk * W + Dk * D + H * Dk * Dk + H * D + 128 + H * Dk + Dk + D * H * Dk
    Hm, Q, C, N, R, Dv = 4, 64, 64, 32, 16, 32
    mla = Q * D + Q + Hm * (N + R) * Q + (C + R) * D + C + Hm * (N + Dv) * C + Hm * Dv * D + D * Hm * Dv
    Hi, Di = 2, 32
    indexer = Hi * Di * Q + Di * D + 2 * Di + Hi * D
    dense = 3 * 512 * D
    X, Lt, I, Is = 16, 128, 64, 128
    expert = 3 * I * Lt
    moe_fixed = X * D + X + 2 * Lt * D + Lt + 3 * Is * D
    norms = 6 * D
    total = 2 * V * D + 3 * D + 8 * norms + 6 * kda + 2 * (mla + indexer) + dense + 7 * (moe_fixed + X * expert)
    active = total - V * D - 7 * (X - 4) * expert
    return total, active


def test_inspect_nano_counts(kestrel_bin, nano_dir):
    cfg = json.loads((nano_dir / "config.json").read_text())
    r = run_kestrel(kestrel_bin, "inspect", nano_dir)
    assert r.returncode == 0, r.stderr
    total, active = nano_param_count()
    out = r.stdout
    vision = 0
    for line in out.splitlines():
        if line.startswith(("vision ", "projector ")) and len(line.split()) == 4:
            vision += int(line.split()[1])
    assert ("vision_config" in cfg) == (vision > 0)
    assert f"total parameters  {total + vision} " in out, out
    assert f"active parameters {active} " in out, out
    assert "layer pattern     KKKMKKKM" in out
    assert "all bound and shape-checked" in out


def test_inspect_full_k31_pro(kestrel_bin):
    r = run_kestrel(kestrel_bin, "inspect", FULL_CONFIG, "--config-only")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("total parameters"))
    total = int(line.split()[2])
    line = next(l for l in r.stdout.splitlines() if l.startswith("active parameters"))
    active = int(line.split()[2])
    assert abs(total / 1e12 - 2.8) < 0.05, total
    assert abs(active / 1e9 - 104) < 1.0, active
    assert "TP=8" in r.stdout and "TP=16" in r.stdout


def test_inspect_generated_full_config_matches_fixture(kestrel_bin, tmp_path):
    """The generator's full config and our hand-written fixture describe the same model."""
    out = make_checkpoint(tmp_path / "full", "full", "--config-only")
    a = run_kestrel(kestrel_bin, "inspect", out, "--config-only")
    b = run_kestrel(kestrel_bin, "inspect", FULL_CONFIG, "--config-only")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    pick = lambda s: [l for l in s.splitlines() if l.startswith(("total parameters", "active parameters", "tensors"))]
    assert pick(a.stdout) == pick(b.stdout)


def test_inspect_mini_config_only(kestrel_bin, tmp_path):
    out = make_checkpoint(tmp_path / "mini", "mini", "--config-only")
    r = run_kestrel(kestrel_bin, "inspect", out, "--config-only")
    assert r.returncode == 0, r.stderr
    assert "hidden / vocab    7168 / 163840" in r.stdout
    assert "MoE               112 experts, top-2" in r.stdout
    assert "KDA               12 heads x 128" in r.stdout


# ---------------------------------------------------------------------------------------------
# corrupted inputs: one test each, checking the specific message
def test_truncated_shard(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, EMBED)
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 1000])
    expect_failure(kestrel_bin, nano_copy, shard.name, "past the end of the data section", "truncated")


def test_absurd_header_length(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 50)
    shard.write_bytes(bytes(raw))
    expect_failure(kestrel_bin, nano_copy, shard.name, "header length", "exceeds")


def test_bad_json_header(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8:8 + n] = b'{"broken": [' + b" " * (n - 12)
    shard.write_bytes(bytes(raw))
    expect_failure(kestrel_bin, nano_copy, shard.name, "not valid JSON")


def test_overlapping_ranges(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]
    la = header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
    lb = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0] + max(1, la // 2)
    header[b]["data_offsets"] = [start, start + lb]
    write_st(shard, header, data)
    expect_failure(kestrel_bin, nano_copy, shard.name, "overlap")


def test_unknown_dtype(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    header[NORM]["dtype"] = "Q4_K"
    write_st(shard, header, data)
    expect_failure(kestrel_bin, nano_copy, shard.name, NORM, "unknown dtype 'Q4_K'")


def test_wrong_shape(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    header[NORM]["shape"] = [128, 2]          # same bytes, wrong shape for the config
    write_st(shard, header, data)
    expect_failure(kestrel_bin, nano_copy, f"tensor '{NORM}' has shape [128, 2], expected [256]")


def test_wrong_dtype(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    header[NORM]["dtype"] = "F16"             # same size, wrong type
    write_st(shard, header, data)
    expect_failure(kestrel_bin, nano_copy, f"tensor '{NORM}' has dtype F16, expected BF16")


def test_missing_tensor(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    del header[NORM]
    write_st(shard, header, data)
    idx = index_of(nano_copy)
    del idx["weight_map"][NORM]
    (nano_copy / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_failure(kestrel_bin, nano_copy, f"missing tensor '{NORM}' (expected BF16 [256])")


def test_missing_and_extra_are_listed_together(kestrel_bin, nano_copy):
    shard = shard_with(nano_copy, NORM)
    header, data = read_st(shard)
    header["language_model.model.bogus.weight"] = header.pop(NORM)
    write_st(shard, header, data)
    idx = index_of(nano_copy)
    idx["weight_map"]["language_model.model.bogus.weight"] = idx["weight_map"].pop(NORM)
    (nano_copy / "model.safetensors.index.json").write_text(json.dumps(idx))
    err = expect_failure(kestrel_bin, nano_copy, "2 problems", f"missing tensor '{NORM}'",
                         "unexpected tensor 'language_model.model.bogus.weight'")
    assert err.count("\n  - ") == 2


def test_tensor_listed_in_index_but_absent_from_shard(kestrel_bin, nano_copy):
    idx = index_of(nano_copy)
    idx["weight_map"]["language_model.model.ghost.weight"] = idx["weight_map"][NORM]
    (nano_copy / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_failure(kestrel_bin, nano_copy, "'language_model.model.ghost.weight' is listed in the index but missing")


def test_index_names_missing_shard(kestrel_bin, nano_copy):
    idx = index_of(nano_copy)
    idx["weight_map"][NORM] = "model-99999-of-99999.safetensors"
    (nano_copy / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_failure(kestrel_bin, nano_copy, "shard 'model-99999-of-99999.safetensors'", "does not exist")


def test_malformed_config(kestrel_bin, nano_copy):
    cfg = json.loads((nano_copy / "config.json").read_text())
    del cfg["text_config"]["hidden_size"]
    (nano_copy / "config.json").write_text(json.dumps(cfg))
    expect_failure(kestrel_bin, nano_copy, "config.json", "text_config.hidden_size", "is missing")


def test_config_not_json(kestrel_bin, nano_copy):
    (nano_copy / "config.json").write_text("{ this is not json")
    expect_failure(kestrel_bin, nano_copy, "config.json", "not valid JSON")


def test_config_layer_lists_inconsistent(kestrel_bin, nano_copy):
    cfg = json.loads((nano_copy / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"] = [4]
    (nano_copy / "config.json").write_text(json.dumps(cfg))
    expect_failure(kestrel_bin, nano_copy, "layer 8 (1-indexed) is in neither")


def test_not_a_directory(kestrel_bin, tmp_path):
    r = run_kestrel(kestrel_bin, "inspect", tmp_path / "nothing-here")
    assert r.returncode == 1 and "error:" in r.stderr

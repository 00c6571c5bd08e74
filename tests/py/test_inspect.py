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


# ---------------------------------------------------------------------------------------------
# memory per GPU under the parallel layouts, by hand from MODEL.md §2 and the sharding rules of
# docs/parallel.md (rows/columns split N ways; whole: norms, AttnRes vectors, KDA f_a_proj and o_norm,
# MLA q_a/kv_a and their norms, indexer wk and k_norm, vision; experts split N ways either way)
GIB = 1 << 30


def full_rank_bytes(n):
    D, V = 7168, 163840
    bf, f4 = 2, 4
    total = 2 * (V // n) * D * bf                       # embed_tokens, lm_head: vocabulary rows
    total += 3 * D * bf + 93 * 6 * D * bf               # final norm + AttnRes vectors; 6 per layer
    H, Dk = 96 // n, 128
    kda = (4 * H * Dk * D * bf                          # q, k, v, g_proj
           + 3 * H * Dk * 4 * f4                        # conv weights [H*Dk, 1, 4] f32
           + 128 * D * bf + H * Dk * 128 * bf + H * D * bf   # f_a (whole), f_b, b_proj
           + H * f4 + H * Dk * f4 + 128 * f4            # A_log (first H of this rank), dt_bias, o_norm (whole)
           + D * H * Dk * bf)                           # o_proj columns
    Hm = 96 // n
    mla = (1536 * D * bf + 1536 * bf + 576 * D * bf + 512 * bf   # q_a, kv_a and their norms: whole
           + Hm * 192 * 1536 * bf + Hm * 256 * 512 * bf          # q_b, kv_b: heads
           + Hm * 128 * D * bf + D * Hm * 128 * bf)              # g_proj rows, o_proj columns
    indexer = (32 // n) * 128 * 1536 * bf + 128 * D * bf + 2 * 128 * bf + (32 // n) * D * bf
    dense = 3 * (33792 // n) * D * bf
    expert = 17547264                                   # MODEL.md §2: one expert's six tensors
    moe = ((896 // n) * D * bf + (896 // n) * f4        # router rows and correction bias
           + 2 * (3584 // n) * D * bf + (3584 // n) * bf   # latent down rows, up columns, norm
           + 896 * expert // n                          # experts: I/n of each, or 896/n whole ones
           + 3 * (6144 // n) * D * bf)                  # shared experts
    vision = (1024 * 3 * 14 * 14 + 64 * 64 * 1024 + 27 * (2 * 1024 + 4608 * 1024 + 1024 * 1536 + 4096 * 1024
              + 1024 * 4096) + 1024 + 4096 * 4096 + 7168 * 4096 + 7168) * bf
    return total + 69 * kda + 24 * (mla + indexer) + dense + 92 * moe + vision


def parse_layouts(out):
    rows = {}
    for line in out.splitlines():
        if line.startswith("layout ") and " weights " in line:
            f = line.split()
            rows[f[1]] = dict(weights=int(f[3]), cache=int(line.split("MLA cache ")[1].split()[0]),
                              kda=int(line.split("KDA state ")[1].split()[0]))
    return rows


def test_inspect_full_memory_per_gpu_by_layout(kestrel_bin):
    r = run_kestrel(kestrel_bin, "inspect", FULL_CONFIG, "--config-only")
    assert r.returncode == 0, r.stderr
    rows = parse_layouts(r.stdout)
    assert set(rows) == {"TP1", "TP8", "TP8+EP8", "TP8+EP8+DCP8", "TP16+EP16"}, r.stdout
    for name, n in (("TP8", 8), ("TP8+EP8", 8), ("TP8+EP8+DCP8", 8), ("TP16+EP16", 16)):
        assert rows[name]["weights"] == full_rank_bytes(n), name
    # TP1 is the whole checkpoint, A_log's padding included (69 layers x 32 unused f32 heads): 1.42 TiB.
    assert rows["TP1"]["weights"] == full_rank_bytes(1) + 69 * (128 - 96) * 4
    # MLA cache per token: 24 layers x (bf16 latent 576 x 2 + fp8 index key 128 + 4); DCP8 spreads it.
    assert rows["TP8"]["cache"] == 24 * (1152 + 132)
    assert rows["TP8+EP8+DCP8"]["cache"] == 24 * (1152 + 132) // 8
    # KDA state per request and rank: 69 layers x (H/n heads of 128 x 128 f32 + conv 3 x H/n x 128 x 3 bf16).
    for name, n in (("TP8", 8), ("TP16+EP16", 16)):
        assert rows[name]["kda"] == 69 * ((96 // n) * 128 * 128 * 4 + 3 * (96 // n) * 128 * 3 * 2)

    fits = {}
    for line in r.stdout.splitlines():
        if line.startswith("fit "):
            count, x, gpu, layout, verdict = line[4:].split(None, 4)
            fits[(f"{count} {x} {gpu}", layout)] = verdict
    h200, mi355x, reserve = int(139.8 * GIB), 288 * GIB, 6 * GIB
    one_request = lambda name: rows[name]["kda"] + rows[name]["cache"] * 1048576
    for (platform, name), verdict in fits.items():
        n = 16 if name.startswith("TP16") else 8
        gpus = 16 if platform.startswith("16") else 8
        mem = mi355x if "MI355X" in platform else h200
        free = mem - full_rank_bytes(n) - reserve
        if gpus % n:
            assert verdict.startswith("n/a"), (platform, name, verdict)
        elif free >= one_request(name):
            assert verdict.startswith("fits"), (platform, name, verdict)
            assert f"{free / GIB:.2f} GiB free" in verdict
            assert f"= {(free - rows[name]['kda']) // rows[name]['cache']} tokens" in verdict
        else:
            assert verdict.startswith("no"), (platform, name, verdict)
    # The answers the layouts exist for: the full model does not fit one 8 x H200 node, fits two
    # (TP16/EP16) and one 8 x MI355X node (TP8, also with DCP8).
    assert fits[("8 x H200", "TP8")].startswith("no") and fits[("8 x H200", "TP8+EP8")].startswith("no")
    assert fits[("16 x H200", "TP16+EP16")].startswith("fits")
    assert fits[("8 x MI355X", "TP8")].startswith("fits") and fits[("8 x MI355X", "TP8+EP8+DCP8")].startswith("fits")
    assert fits[("8 x H200", "TP16+EP16")].startswith("n/a")


def test_inspect_caches_per_rank(kestrel_bin):
    # The engine's memory plan for one rank (issue #16 c), worked out by hand: under TP8 + DCP8 a KDA slot
    # holds 12 of the 96 heads (69 x (12 x 128 x 128 x 4 + 3 x 3 x 12 x 128 x 2) B) and a 128-token page
    # 16 rows per rank (24 layers x 1,284 B x 16).
    r = run_kestrel(kestrel_bin, "inspect", FULL_CONFIG, "--config-only", "--tensor-parallel-size", "8",
                    "--decode-context-parallel-size", "8")
    assert r.returncode == 0, r.stderr
    assert "KDA state split by heads (12 of 96 per rank)" in r.stdout, r.stdout
    assert "spread along tokens over DCP8 (a 128-token page is 16 rows per rank)" in r.stdout, r.stdout
    assert f"= {24 * 1284 * 16} B;" in r.stdout, r.stdout
    assert f"= {69 * (12 * 128 * 128 * 4 + 3 * 3 * 12 * 128 * 2)} B" in r.stdout, r.stdout
    # (TP8 without DCP, pages whole per rank: CacheLayout.FullModelPerRankBytes in the unit tests.)


def test_inspect_layout_that_does_not_divide_is_one_error(kestrel_bin, nano_dir):
    r = run_kestrel(kestrel_bin, "inspect", nano_dir, "--tensor-parallel-size", "4")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: cannot run this model as TP4 (2 problems):"), r.stderr
    assert "index_n_heads = 2" in r.stderr and "moe_intermediate_size = 64" in r.stderr


def test_inspect_binds_every_rank_shard(kestrel_bin, nano_dir):
    r = run_kestrel(kestrel_bin, "inspect", nano_dir, "--tensor-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    per_rank = [int(l.split()[7]) for l in r.stdout.splitlines() if l.startswith("shard TP2 rank")]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1], r.stdout
    line = next(l for l in r.stdout.splitlines() if l.startswith("layout TP2:"))
    assert int(line.split()[2]) == per_rank[0]


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

// Paged MLA caches on the GPU (kernels/cuda/paged.h) against the CPU's paged views (model/cache_view.h):
// writes must give the CPU writer's bytes exactly (every format, untouched bytes left alone); reads through
// shuffled block tables must give the CPU's absorbed decode (within the tolerance paged.h states for the
// tensor-core decode) and the CPU's indexer selection exactly, for varlen batches of requests.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "gpu_ref.h"
#include "harness.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/paged.h"
#include "model/cache_view.h"

namespace kestrel::gputest {
namespace {

const cpu::MlaDims kNano{4, 32, 16, 32, 64}, kMini{12, 128, 64, 128, 512};

// Requests with their own block tables over one shared pool of pages, pages handed out in a random order.
struct Pages {
  int P;
  int64_t n_pages, max_blocks;
  std::vector<int32_t> tables;  // i32 [B, max_blocks], −1 past each request's blocks
  std::vector<int64_t> lens;

  Pages(int P_, const std::vector<int64_t>& lens_, Rng& r) : P(P_), lens(lens_) {
    max_blocks = 1;
    n_pages = 3;  // a few pages nobody owns
    for (int64_t n : lens) {
      max_blocks = std::max(max_blocks, (n + P - 1) / P);
      n_pages += (n + P - 1) / P;
    }
    std::vector<int32_t> perm(static_cast<size_t>(n_pages));
    std::iota(perm.begin(), perm.end(), 0);
    for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[r.next() % i]);
    tables.assign(lens.size() * size_t(max_blocks), -1);
    size_t next = 0;
    for (size_t b = 0; b < lens.size(); ++b)
      for (int64_t j = 0; j < (lens[b] + P - 1) / P; ++j) tables[b * size_t(max_blocks) + size_t(j)] = perm[next++];
  }
  int64_t blocks(size_t b) const { return (lens[b] + P - 1) / P; }
  int64_t slot(size_t b, int64_t pos) const {
    return int64_t(tables[b * size_t(max_blocks) + size_t(pos / P)]) * P + pos % P;
  }
};

model::MlaCacheView cpu_view(const cpu::MlaDims& d, int64_t Di, LatentFormat lf, IndexKeyFormat kf, int P,
                             std::vector<uint8_t>& lat, std::vector<uint8_t>& keys, const Pages& pg, size_t b) {
  model::MlaCacheView v;
  v.latent_format = lf, v.key_format = kf, v.block_size = P, v.C = d.C, v.R = d.R, v.Di = Di;
  v.latent = lat.data(), v.keys = keys.data();
  v.block_table = std::span<const int32_t>(pg.tables.data() + b * size_t(pg.max_blocks), size_t(pg.blocks(b)));
  return v;
}

cuda::PagedMlaCache gpu_cache(const cpu::MlaDims& d, int64_t Di, LatentFormat lf, IndexKeyFormat kf, int P,
                              uint8_t* lat, uint8_t* keys, const int32_t* tables, int64_t stride) {
  cuda::PagedMlaCache c;
  c.latent_format = lf, c.key_format = kf;
  c.block_size = P, c.C = d.C, c.R = d.R, c.Di = Di, c.latent = lat, c.keys = keys;
  c.block_tables = tables, c.bt_stride = stride;
  return c;
}

// Rows of T tokens: mostly model-like values, plus rows that hit the quantisers' edges (amax under the
// 1e-4 floor, large magnitudes, a zero row, one dominant value per group).
std::vector<uint16_t> rand_rows(int64_t T, int64_t W, Rng& r) {
  auto x = rand_bf16(size_t(T * W), r, -1.5f, 1.5f);
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = x.data() + t * W;
    switch (t % 7) {
      case 2:
        for (int64_t i = 0; i < W; ++i) row[i] = f32_to_bf16(r.uniform(-3e-5f, 3e-5f));
        break;
      case 3:
        for (int64_t i = 0; i < W; ++i) row[i] = f32_to_bf16(r.uniform(-900.0f, 900.0f));
        break;
      case 4:
        if (t % 14 == 4) std::fill(row, row + W, uint16_t(0));
        break;
      case 5:
        for (int64_t i = 0; i < W; i += 17) row[i] = f32_to_bf16(r.uniform(20.0f, 60.0f));
        break;
      default:
        break;
    }
  }
  return x;
}

const char* lname(LatentFormat f) { return format_name(f); }
const char* kname(IndexKeyFormat f) { return format_name(f); }

TEST(GpuPaged, WritesBitExact) {
  need_gpu();
  Rng rng(51);
  struct Shape {
    cpu::MlaDims d;
    int64_t Di;
    int P;
    const char* what;
  };
  for (const Shape& sh : {Shape{kNano, 32, 16, "nano P=16"}, Shape{kNano, 32, 128, "nano"},
                          Shape{kMini, 128, 128, "mini"}}) {
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      for (IndexKeyFormat kf : {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4, IndexKeyFormat::bf16}) {
        const auto& d = sh.d;
        const Pages pg(sh.P, {5, 130, 257}, rng);
        const cuda::PagedMlaCache shape_only = gpu_cache(d, sh.Di, lf, kf, sh.P, nullptr, nullptr, nullptr, 0);
        const int64_t ltb = shape_only.latent_token_bytes(), ktb = shape_only.key_token_bytes();
        // Both arenas start as the same random bytes: bytes no token owns must survive unchanged.
        auto lat_cpu = rand_u8(size_t(pg.n_pages * sh.P * ltb), rng, 0, 255);
        auto key_cpu = rand_u8(size_t(pg.n_pages * sh.P * ktb), rng, 0, 255);
        const auto lat0 = lat_cpu, key0 = key_cpu;
        auto dlat = upload(lat_cpu);
        auto dkey = upload(key_cpu);
        int64_t T = 0;
        for (int64_t n : pg.lens) T += n;
        const auto rows = rand_rows(T, d.cw(), rng);
        const auto keys = rand_rows(T, sh.Di, rng);
        std::vector<int64_t> slots;
        int64_t t = 0;
        for (size_t b = 0; b < pg.lens.size(); ++b) {
          const auto v = cpu_view(d, sh.Di, lf, kf, sh.P, lat_cpu, key_cpu, pg, b);
          for (int64_t pos = 0; pos < pg.lens[b]; ++pos, ++t) {
            // Every 11th row is skipped (slot −1) on the GPU, so the CPU must not write it either.
            if (t % 11 == 7) {
              slots.push_back(-1);
              continue;
            }
            v.write_latent(pos, rows.data() + t * d.cw());
            v.write_key(pos, keys.data() + t * sh.Di);
            slots.push_back(pg.slot(b, pos));
          }
        }
        auto drows = upload(rows);
        auto dkeys = upload(keys);
        auto dslots = upload(slots);
        const auto c = gpu_cache(d, sh.Di, lf, kf, sh.P, dlat.p(), dkey.p(), nullptr, 0);
        cuda::paged_write_latent(c, drows.p(), d.cw(), dslots.p(), T, nullptr);
        cuda::paged_write_keys(c, dkeys.p(), sh.Di, dslots.p(), T, nullptr);
        sync();
        const std::string shape = fmt::format("{} latent {} keys {} T={}", sh.what, lname(lf), kname(kf), T);
        const auto got_lat = dlat.get(), got_key = dkey.get();
        check_exact("paged_write_latent (arena bytes)", shape, got_lat.data(), lat_cpu.data(), lat_cpu.size());
        check_exact("paged_write_keys (arena bytes)", shape, got_key.data(), key_cpu.data(), key_cpu.size());
        // The i32-slot overloads (the GPU engine's) write the same bytes.
        std::vector<int32_t> slots32(slots.begin(), slots.end());
        auto dlat32 = upload(lat0);
        auto dkey32 = upload(key0);
        auto dslots32 = upload(slots32);
        const auto c32 = gpu_cache(d, sh.Di, lf, kf, sh.P, dlat32.p(), dkey32.p(), nullptr, 0);
        cuda::paged_write_latent(c32, drows.p(), d.cw(), dslots32.p(), T, nullptr);
        cuda::paged_write_keys(c32, dkeys.p(), sh.Di, dslots32.p(), T, nullptr);
        sync();
        const auto got_lat32 = dlat32.get(), got_key32 = dkey32.get();
        check_exact("paged_write_latent i32 slots", shape, got_lat32.data(), lat_cpu.data(), lat_cpu.size());
        check_exact("paged_write_keys i32 slots", shape, got_key32.data(), key_cpu.data(), key_cpu.size());
      }
    }
  }
}

// MLA's norms and cache writes in one launch (mla_norms_and_writes) against the separate launches it replaces
// (rmsnorm_bf16 twice, paged_write_latent, indexer_key_norm, paged_write_keys): the same normalised rows and the
// same arena bytes, for every format, with and without an indexer, skipped rows (slot −1) included.
TEST(GpuPaged, MlaNormsAndWritesMatchSeparateLaunches) {
  need_gpu();
  Rng rng(52);
  struct Shape {
    cpu::MlaDims d;
    int64_t Q, Di;
    int P;
    const char* what;
  };
  for (const Shape& sh : {Shape{kNano, 96, 32, 16, "nano P=16"}, Shape{kMini, 1536, 128, 128, "mini"},
                          Shape{kNano, 64, 0, 128, "nano, no indexer"}}) {
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      for (IndexKeyFormat kf : {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4, IndexKeyFormat::bf16}) {
        const auto& d = sh.d;
        const int64_t CW = d.cw(), Q = sh.Q, Di = sh.Di;
        const Pages pg(sh.P, {3, 70}, rng);
        const cuda::PagedMlaCache shape_only = gpu_cache(d, Di, lf, kf, sh.P, nullptr, nullptr, nullptr, 0);
        const auto lat0 = rand_u8(size_t(pg.n_pages * sh.P * shape_only.latent_token_bytes()), rng, 0, 255);
        const auto key0 = rand_u8(size_t(pg.n_pages * sh.P * std::max<int64_t>(1, shape_only.key_token_bytes())),
                                  rng, 0, 255);
        const int64_t T = 73;
        std::vector<int32_t> slots;
        for (size_t b = 0; b < pg.lens.size(); ++b)
          for (int64_t pos = 0; pos < pg.lens[b]; ++pos)
            slots.push_back(slots.size() % 11 == 7 ? -1 : int32_t(pg.slot(b, pos)));
        const auto qa = rand_rows(T, Q, rng), rows = rand_rows(T, CW, rng);
        const auto kraw = Di ? rand_rows(T, Di, rng) : std::vector<uint16_t>{};
        auto dqa = upload(qa);
        auto dqw = upload(rand_bf16(size_t(Q), rng, 0.5f, 1.5f));
        auto dkvw = upload(rand_bf16(size_t(d.C), rng, 0.5f, 1.5f));
        auto dkw = upload(rand_bf16(size_t(std::max<int64_t>(Di, 1)), rng, 0.5f, 1.5f));
        auto dkb = upload(rand_bf16(size_t(std::max<int64_t>(Di, 1)), rng, -0.2f, 0.2f));
        auto dkraw = upload(Di ? kraw : std::vector<uint16_t>(1));
        auto dslots = upload(slots);
        const float eps = 1e-6f;
        // Separate launches.
        auto lat1 = upload(lat0), key1 = upload(key0);
        auto rows1 = upload(rows);
        auto cq1 = poisoned<uint16_t>(size_t(T * Q));
        auto knew1 = poisoned<uint16_t>(size_t(std::max<int64_t>(T * Di, 1)));
        const auto c1 = gpu_cache(d, Di, lf, kf, sh.P, lat1.p(), Di ? key1.p() : nullptr, nullptr, 0);
        cuda::rmsnorm_bf16(dqa.p(), Q, dqw.p(), cq1.p(), Q, T, Q, eps, nullptr);
        cuda::rmsnorm_bf16(rows1.p(), CW, dkvw.p(), rows1.p(), CW, T, d.C, eps, nullptr);
        cuda::paged_write_latent(c1, rows1.p(), CW, dslots.p(), T, nullptr);
        if (Di) {
          cuda::indexer_key_norm(dkraw.p(), dkw.p(), dkb.p(), T, Di, knew1.p(), nullptr);
          cuda::paged_write_keys(c1, knew1.p(), Di, dslots.p(), T, nullptr);
        }
        // One launch.
        auto lat2 = upload(lat0), key2 = upload(key0);
        auto rows2 = upload(rows);
        auto cq2 = poisoned<uint16_t>(size_t(T * Q));
        auto knew2 = poisoned<uint16_t>(size_t(std::max<int64_t>(T * Di, 1)));
        const auto c2 = gpu_cache(d, Di, lf, kf, sh.P, lat2.p(), Di ? key2.p() : nullptr, nullptr, 0);
        cuda::MlaProjNorms pn;
        pn.qa = dqa.p(), pn.cq = cq2.p(), pn.q_a_norm = dqw.p(), pn.Q = Q, pn.rows = rows2.p(), pn.kv_a_norm = dkvw.p();
        if (Di) pn.kraw = dkraw.p(), pn.knew = knew2.p(), pn.k_norm = dkw.p(), pn.k_norm_bias = dkb.p();
        pn.eps = eps;
        cuda::mla_norms_and_writes(c2, pn, dslots.p(), T, nullptr);
        sync();
        const std::string shape = fmt::format("{} Q={} latent {} keys {}", sh.what, Q, lname(lf), kname(kf));
        EXPECT_EQ(cq2.get(), cq1.get()) << "c_q: " << shape;
        EXPECT_EQ(rows2.get(), rows1.get()) << "normalised [c | k_pe]: " << shape;
        EXPECT_NE(rows1.get(), rows) << "the norm changed nothing: " << shape;
        const auto got_lat = lat2.get(), want_lat = lat1.get();
        check_exact("mla_norms_and_writes latent arena", shape, got_lat.data(), want_lat.data(), want_lat.size());
        const auto got_key = key2.get(), want_key = key1.get();
        check_exact("mla_norms_and_writes key arena", shape, got_key.data(), want_key.data(), want_key.size());
        if (Di) {
          EXPECT_EQ(knew2.get(), knew1.get()) << "indexer keys: " << shape;
        } else {
          EXPECT_EQ(got_key, key0) << "no indexer, but the key arena changed: " << shape;
          break;  // the key format does not matter without an indexer
        }
      }
    }
  }
}

// Fills a paged cache on the CPU (random rows through MlaCacheView) and uploads it with its tables.
struct FilledCache {
  std::vector<uint8_t> lat, keys;
  Dev<uint8_t> dlat, dkeys;
  Dev<int32_t> dtables;
};
FilledCache fill_cache(const cpu::MlaDims& d, int64_t Di, LatentFormat lf, IndexKeyFormat kf, const Pages& pg,
                       int key_dup, Rng& rng) {
  FilledCache f;
  const cuda::PagedMlaCache shape_only = gpu_cache(d, Di, lf, kf, pg.P, nullptr, nullptr, nullptr, 0);
  f.lat = rand_u8(size_t(pg.n_pages * pg.P * shape_only.latent_token_bytes()), rng, 0, 255);
  f.keys = rand_u8(size_t(pg.n_pages * pg.P * std::max<int64_t>(1, shape_only.key_token_bytes())), rng, 0, 255);
  for (size_t b = 0; b < pg.lens.size(); ++b) {
    const auto v = cpu_view(d, Di, lf, kf, pg.P, f.lat, f.keys, pg, b);
    const int64_t S = pg.lens[b];
    const auto rows = rand_bf16(size_t(S * d.cw()), rng, -1.5f, 1.5f);
    for (int64_t pos = 0; pos < S; ++pos) v.write_latent(pos, rows.data() + pos * d.cw());
    if (Di > 0) {
      auto keys = rand_bf16(size_t(S * Di), rng, -2.0f, 2.0f);
      // key_dup > 0: key s copies key s % key_dup, so many positions score exactly alike.
      if (key_dup)
        for (int64_t s = key_dup; s < S; ++s) std::copy_n(keys.begin() + (s % key_dup) * Di, Di, keys.begin() + s * Di);
      for (int64_t pos = 0; pos < S; ++pos) v.write_key(pos, keys.data() + pos * Di);
    }
  }
  f.dlat = upload(f.lat);
  f.dkeys = upload(f.keys);
  f.dtables = upload(pg.tables);
  return f;
}

// The naive prefill's gather: every token of every request, in a shuffled order of pool rows, dequantised
// to the bytes MlaCacheView::read_latent gives (BF16 and FP8 latent).
TEST(GpuPaged, GatherLatentMatchesCpuRead) {
  need_gpu();
  Rng rng(53);
  for (const auto& [d, what] : {std::pair{kNano, "nano"}, std::pair{kMini, "mini"}}) {
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      const Pages pg(16, {5, 40, 129}, rng);
      FilledCache f = fill_cache(d, 0, lf, IndexKeyFormat::bf16, pg, 0, rng);
      std::vector<int32_t> rows;
      std::vector<uint16_t> want;
      for (size_t b = 0; b < pg.lens.size(); ++b) {
        const auto v = cpu_view(d, 0, lf, IndexKeyFormat::bf16, pg.P, f.lat, f.keys, pg, b);
        std::vector<uint16_t> lat(size_t(pg.lens[b] * d.cw()));
        v.read_latent(pg.lens[b], lat.data());
        want.insert(want.end(), lat.begin(), lat.end());
        for (int64_t pos = 0; pos < pg.lens[b]; ++pos) rows.push_back(int32_t(pg.slot(b, pos)));
      }
      // Gather in reverse order: the output follows rows[], not the pool's order.
      std::reverse(rows.begin(), rows.end());
      const int64_t n = int64_t(rows.size()), W = d.cw();
      for (int64_t i = 0; i < n / 2; ++i)
        std::swap_ranges(want.begin() + i * W, want.begin() + (i + 1) * W, want.begin() + (n - 1 - i) * W);
      auto drows = upload(rows);
      auto out = poisoned<uint16_t>(size_t(n * W));
      const auto c = gpu_cache(d, 0, lf, IndexKeyFormat::bf16, pg.P, f.dlat.p(), nullptr, nullptr, 0);
      cuda::paged_gather_latent(c, drows.p(), n, out.p(), nullptr);
      sync();
      const auto got = out.get();
      check_exact("paged_gather_latent", fmt::format("{} latent {} n={}", what, lname(lf), n), got.data(), want.data(),
                  want.size() * 2);
    }
  }
}

// Absorbed decode over the paged latent: B query rows, several sharing a request (speculative tokens
// see different lengths of one cache), dense and sparse, BF16 and FP8 latent.
TEST(GpuPaged, MlaDecode) {
  need_gpu();
  struct Case {
    cpu::MlaDims d;
    int P;
    std::vector<int64_t> lens;  // per request
    int64_t Ksel;
    const char* what;
  };
  Rng rng(52);
  cuda::GemmLt lt;
  std::vector<int64_t> many(40);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 1 + int64_t(rng.next() % 3000);
  for (const Case& c : {Case{kNano, 16, {1, 17, 100}, 0, "nano P=16"}, Case{kNano, 128, {90, 200, 5}, 64, "nano sparse"},
                        Case{kMini, 128, {1, 700, 2048, 8192}, 0, "mini"},
                        Case{kMini, 128, {8192, 3000, 2100}, 2048, "mini sparse"},
                        Case{kMini, 128, many, 0, "mini B=40 varlen"}}) {
    for (LatentFormat lf : {LatentFormat::bf16, LatentFormat::fp8}) {
      const auto& d = c.d;
      const Pages pg(c.P, c.lens, rng);
      FilledCache fc = fill_cache(d, 0, lf, IndexKeyFormat::fp8, pg, 0, rng);
      // Query rows: one per request, plus two extra rows on request 0's cache (lens − 1, lens − 2 if > 0).
      std::vector<int32_t> req, lens, sel;
      for (size_t b = 0; b < c.lens.size(); ++b) req.push_back(int32_t(b)), lens.push_back(int32_t(c.lens[b]));
      for (int64_t back = 1; back <= 2 && c.lens[0] - back > 0; ++back)
        req.push_back(0), lens.push_back(int32_t(c.lens[0] - back));
      const int64_t B = int64_t(req.size());
      const auto q = rand_bf16(size_t(B * d.Hm * d.qk()), rng, -1.0f, 1.0f);
      const auto kvb = rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng, -0.08f, 0.08f);
      std::vector<uint16_t> ref(size_t(B * d.Hm * d.Dv));
      int64_t max_keys = 0;
      for (int64_t r = 0; r < B; ++r) {
        const int64_t S = lens[size_t(r)];
        const auto v = cpu_view(d, 0, lf, IndexKeyFormat::fp8, c.P, fc.lat, fc.keys, pg, size_t(req[size_t(r)]));
        std::vector<uint16_t> lat(size_t(S * d.cw()));
        v.read_latent(S, lat.data());
        const int32_t* sel_row = nullptr;
        if (c.Ksel) {
          const int64_t cnt = std::min(S, c.Ksel - (r % 2) * 5);
          std::vector<int32_t> all(static_cast<size_t>(S));
          std::iota(all.begin(), all.end(), 0);
          for (int64_t i = 0; i < cnt; ++i) std::swap(all[size_t(i)], all[size_t(i + int64_t(rng.next() % uint64_t(S - i)))]);
          std::vector<int32_t> s(all.begin(), all.begin() + cnt);
          std::sort(s.begin(), s.end());
          s.resize(size_t(c.Ksel), -1);
          sel.insert(sel.end(), s.begin(), s.end());
          sel_row = sel.data() + r * c.Ksel;
          max_keys = std::max(max_keys, cnt);
        } else {
          max_keys = std::max(max_keys, S);
        }
        cpu::mla_attn_absorbed(d, q.data() + r * d.Hm * d.qk(), kvb.data(), lat.data(), sel_row, c.Ksel, 1, S - 1,
                               ref.data() + r * d.Hm * d.Dv);
      }
      auto dq = upload(q);
      auto dkvb = upload(kvb);
      auto dsel = upload(sel);
      auto dlens = upload(lens);
      auto dreq = upload(req);
      const auto cache = gpu_cache(d, 0, lf, IndexKeyFormat::fp8, c.P, fc.dlat.p(), nullptr, fc.dtables.p(), pg.max_blocks);
      cuda::MlaPagedBatch bt;
      bt.lens = dlens.p(), bt.req = dreq.p(), bt.sel = c.Ksel ? dsel.p() : nullptr, bt.Ksel = c.Ksel, bt.B = B;
      bt.max_keys = max_keys;
      cuda::DeviceBuffer ws(cuda::mla_decode_paged_workspace_bytes(d, B, max_keys));
      auto dout = poisoned<uint16_t>(ref.size());
      cuda::mla_decode_paged(lt, d, dq.p(), dkvb.p(), cache, bt, ws.data(), dout.p(), nullptr);
      sync();
      // The tensor-core decode rounds q̃ and p to bf16 for the MMA (paged.h): relative L2 ≲ 3e-3, bound 1e-2.
      check_bf16("mla_decode_paged",
                 fmt::format("{} latent {} Hm={} B={} keys<={}{}", c.what, lname(lf), d.Hm, B, max_keys,
                             c.Ksel ? " sel" : ""),
                 dout.get(), ref, {2e-3, 2 * kBf16Ulp, 1e-2});
    }
  }
}

// Indexer selection over paged keys: decode rows (one per request) and prefill rows (several positions of
// one request) in one launch; the ids must equal the CPU's exactly, ties included.
TEST(GpuPaged, IndexerSelect) {
  need_gpu();
  struct Case {
    int64_t Hi, Di, Ki;
    int P;
    std::vector<int64_t> lens;
    int dup;
    const char* what;
  };
  Rng rng(53);
  for (const Case& c : {Case{2, 32, 64, 16, {5, 100, 61, 300}, 0, "nano P=16"}, Case{2, 32, 64, 128, {300, 129}, 7, "nano ties"},
                        Case{32, 128, 2048, 128, {2046, 2049, 5000, 8192}, 0, "mini"},
                        Case{32, 128, 2048, 128, {5000, 3000}, 1000, "mini ties"}}) {
    for (IndexKeyFormat kf : {IndexKeyFormat::fp8, IndexKeyFormat::mxfp4, IndexKeyFormat::bf16}) {
      const cpu::MlaDims d = c.Hi == 2 ? kNano : kMini;
      const Pages pg(c.P, c.lens, rng);
      FilledCache fc = fill_cache(d, c.Di, LatentFormat::bf16, kf, pg, c.dup, rng);
      std::vector<int32_t> req, lens;
      for (size_t b = 0; b < c.lens.size(); ++b) req.push_back(int32_t(b)), lens.push_back(int32_t(c.lens[b]));
      // Prefill-style rows: the last request's positions len−1−3i.
      for (int64_t i = 1; i <= 3 && c.lens.back() - 3 * i > 0; ++i)
        req.push_back(int32_t(c.lens.size() - 1)), lens.push_back(int32_t(c.lens.back() - 3 * i));
      const int64_t T = int64_t(req.size());
      int64_t max_len = 0;
      for (int32_t n : lens) max_len = std::max<int64_t>(max_len, n);
      const auto qi = rand_bf16(size_t(T * c.Hi * c.Di), rng, -1.0f, 1.0f);
      const auto hw = rand_f32(size_t(T * c.Hi), rng, -1.0f, 2.0f);
      std::vector<int32_t> ref(size_t(T * c.Ki));
      for (int64_t t = 0; t < T; ++t) {
        const int64_t S = lens[size_t(t)];
        const auto v = cpu_view(d, c.Di, LatentFormat::bf16, kf, c.P, fc.lat, fc.keys, pg, size_t(req[size_t(t)]));
        std::vector<uint16_t> keys(size_t(S * c.Di));
        v.read_keys(S, keys.data());
        cpu::indexer_select_topk(qi.data() + t * c.Hi * c.Di, keys.data(), hw.data() + t * c.Hi, 1, S - 1, c.Hi, c.Di,
                                 c.Ki, ref.data() + t * c.Ki);
      }
      auto dq = upload(qi);
      auto dh = upload(hw);
      auto dlens = upload(lens);
      auto dreq = upload(req);
      auto dscores = poisoned<float>(size_t(T * max_len));
      auto dsel = poisoned<int32_t>(ref.size());
      std::vector<int32_t> junk(ref.size(), 0x7fffffff);  // an id never written shows as a mismatch
      dsel.buf.copy_from_host(junk.data(), junk.size() * 4);
      const auto cache = gpu_cache(d, c.Di, LatentFormat::bf16, kf, c.P, fc.dlat.p(), fc.dkeys.p(), fc.dtables.p(),
                                   pg.max_blocks);
      cuda::indexer_select_paged(dq.p(), dh.p(), cache, dlens.p(), dreq.p(), T, max_len, c.Hi, c.Ki, dscores.p(),
                                 max_len, dsel.p(), nullptr);
      sync();
      const auto got = dsel.get();
      check_exact("indexer_select_paged (top-k ids)",
                  fmt::format("{} keys {} Hi={} Di={} k={} T={} max_len={}", c.what, kname(kf), c.Hi, c.Di, c.Ki, T,
                              max_len),
                  got.data(), ref.data(), ref.size() * 4);
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest

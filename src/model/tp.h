// Tensor and expert parallelism inside the CPU layer forwards (docs/parallel.md §3 and §8): the few
// collectives a layer calls at its sublayer ends, and the per-rank preparation of weights.
//
// A rank runs the same forward as one rank would, on the views bind_shard() gave it (loader/shard.h)
// and on a config whose head counts are its own (rank_config): KDA, MLA and indexer layers then run
// H/N, Hm/N and Hi/N heads without knowing it. What remains rank-aware is at the ends of sublayers:
// a row-parallel projection writes an f32 partial sum that reduce_to_bf16() adds over ranks (rank
// order, f32, one BF16 rounding — the same single rounding the unsplit Lin does), and a column
// slice of an activation another rank computed comes back through gather_columns(). With comm ==
// nullptr (or a group of one) every helper is the identity and the layers run their one-rank code.
//
// Numerics: a split sum adds the same products in a different order (per rank, then across ranks),
// so TP results equal TP1 to f32 rounding before the one BF16 rounding, i.e. within BF16 noise.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "loader/config.h"
#include "loader/shard.h"
#include "loader/weights.h"

namespace kestrel::parallel {
class Comm;
}

namespace kestrel::model {

// This rank's place in its tensor-parallel group; null = one rank.
struct Shard {
  parallel::Comm* comm = nullptr;
  // Decode context parallelism (mla_dcp.cpp): 1, or size() — every rank of the group holds the MLA
  // latent and index-key rows of the tokens t with t mod size() == rank(), at local row ⌊t/size()⌋.
  int dcp = 1;

  int size() const;
  int rank() const;
  bool split() const { return size() > 1; }
};

// out = bf16(Σ_ranks partial), partial: f32 [n] (overwritten with the f32 sum).
void reduce_to_bf16(const Shard& sh, float* partial /* f32 [n] */, int64_t n, uint16_t* out /* bf16 [n] */);

// Every rank's column block of a [T, w] matrix side by side: full[t, p·w + j] = local_p[t, j].
// local: dt [T, w]; full: dt [T, N·w]. dt any (raw elements).
void gather_columns(const Shard& sh, const void* local, int64_t T, int64_t w, DType dt, void* full);

// The config one rank runs: KDA, MLA and indexer head counts divided by the TP size (everything else,
// including widths the layers read from their weights' shapes, stays global). The layout must be valid.
ModelConfig rank_config(const ModelConfig& c, const ParallelLayout& p);

// Replaces every strided view of `w` (the column slices of row-parallel weights, loader/shard.h) by a
// contiguous copy, which the CPU kernels need; returns the copies' storage, to live as long as `w`.
// Each copy is one rank's 1/N of one tensor; contiguous views are left pointing into the mapping.
std::vector<HostBuffer> pack_strided(const ModelConfig& c, ModelWeights& w);

}  // namespace kestrel::model

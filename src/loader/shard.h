// Tensor-, expert- and context-parallel layout of one rank, and the binding of that rank's shard of
// every tensor straight from the released safetensors (docs/parallel.md, "Sharding rules").
//
// A rank's shard of a tensor is a TensorView into the read-only mapping of its shard file: a row
// range (dim 0) is a contiguous sub-block, a column range (dim 1) a strided view (stride of the full
// row). Nothing is copied, and no rank ever touches bytes outside its own slices, so N ranks together
// read the checkpoint once. Under --enable-expert-parallel the experts a rank does not own stay empty
// views (data == nullptr), indexed by their global id.
//
// The rules, per tensor (N = tp, r = rank; all head reshapes are head-major, MODEL.md §0.7, so a head
// range is a row or column range):
//   rows    KDA q/k/v/g_proj, q/k/v_conv1d, f_b_proj, b_proj, dt_bias, A_log (the first H entries
//           only; the padding is dropped); MLA q_b_proj, kv_b_proj, g_proj; indexer wq_b,
//           weights_proj; dense MLP and shared experts gate/up; router gate.weight and
//           e_score_correction_bias (experts); routed_expert_down_proj and routed_expert_norm
//           (latent Lt); embed_tokens and lm_head (vocabulary); routed experts w1/w3 (intermediate I).
//   cols    KDA and MLA o_proj; dense/shared down_proj; routed_expert_up_proj (latent Lt);
//           routed experts w2 (intermediate I: weight_packed at I/2, weight_scale at I/32).
//   experts with expert parallelism: experts [r·X/N, (r+1)·X/N) whole, the rest absent.
//   whole   norms and AttnRes vectors, KDA f_a_proj and o_norm, MLA q_a_proj, kv_a_proj_with_mqa
//           and their norms, indexer wk and k_norm, vision tower and projector.
// With tp == 1 every tensor is bound whole (bind_weights is bind_shard at the trivial layout).
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel {

class Checkpoint;

struct ParallelLayout {
  int tp = 1;                    // tensor-parallel ranks (--tensor-parallel-size)
  int rank = 0;                  // this rank, [0, tp)
  bool expert_parallel = false;  // --enable-expert-parallel: whole experts per rank, EP size = tp
  int dcp = 1;                   // --decode-context-parallel-size: ranks a request's MLA cache is spread over

  std::string name() const;      // "TP8", "TP8+EP8", "TP8+DCP8"
};

// Where one rank's piece of a tensor lies. dim -1 = the whole tensor; absent = not bound on this rank
// (an expert of another rank). [begin, end) indexes dimension `dim` of the stored tensor.
struct TensorSlice {
  int dim = -1;
  int64_t begin = 0;
  int64_t end = 0;
  bool absent = false;

  bool whole() const { return dim < 0 && !absent; }
};

// Every reason the layout cannot split this config (head, expert, vocabulary or width counts that do
// not divide, MXFP4 blocks cut in half), one per line; empty when it can.
std::vector<std::string> layout_problems(const ModelConfig& c, const ParallelLayout& p);
// Throws one kestrel::Error listing every problem of layout_problems().
void check_layout(const ModelConfig& c, const ParallelLayout& p);

// This rank's slice of tensor `s` (one of for_each_tensor's specs). The layout must be valid.
TensorSlice shard_slice(const TensorSpec& s, const ModelConfig& c, const ParallelLayout& p);

// Shape of the slice (the stored shape with dimension `dim` cut to end - begin; empty for absent).
Shape slice_shape(const Shape& full, const TensorSlice& sl);

// A view of the slice of `full` (contiguous row-major): no copy; strided for dim >= 1.
TensorView slice_view(const TensorView& full, const TensorSlice& sl);

// Binds rank p.rank's shard of every tensor. Validates the layout first, then the checkpoint exactly
// as bind_weights does (missing, extra, mis-shaped, mis-typed tensors: one Error listing all).
ModelWeights bind_shard(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& p);

}  // namespace kestrel

// The batch description of one GPU step: how forward_batch stacks its sequences and what it uploads.
//
// The tokens of every sequence are stacked into one [T, D] activation, single-token sequences (decodes)
// first: every GEMM, norm, router and MoE launch covers the whole batch, KDA runs one varlen scan over
// cu_seqlens, and the absorbed MLA decode covers rows 0..nd−1 in one launch. Two uploads per step, three
// with image rows:
//  - static inputs (token ids [T] | cu_seqlens [n+1] | slot ids [n] | pool rows [T] | logits rows):
//    one copy into scratch for an eager step, or rewritten in place in a CUDA-graph bucket (graphs.h);
//  - context inputs, read only by the attention islands (whose shapes follow the contexts): decode
//    context lengths [nd] | block tables [n, bt_stride] | per-row visible key counts [T] | per-row
//    sequence [T];
//  - image rows (eager steps that have them): the step row of each row of the CudaEmbedRows.
// Nothing is gathered: the indexer, the decode and the prefill attention read the pools through the
// block tables.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/cuda/cuda_model.h"

namespace kestrel::model::gpu {

struct Context;

struct BatchStep {
  int64_t T = 0, n = 0, nd = 0;  // stacked tokens, sequences, leading T = 1 sequences (decodes)
  // DSpark verify sequences (CudaSeq::verify), right after the decodes: sequences nd .. nd+nv−1, rows
  // nd .. nd+nvr−1; they run the decode forms row by row (kda.cpp, mla.cpp). Prefills follow.
  int64_t nv = 0, nvr = 0;
  int64_t max_ver_S = 0;  // longest verify context
  int64_t n_real = 0;            // real sequences (< n when a graph bucket pads the batch)
  // Per real sequence: first row, T_b, pos0_b, slot.
  std::vector<int64_t> row0, len, pos0;
  std::vector<int32_t> slot;
  int64_t max_dec_S = 0;  // longest decode context
  int64_t max_S = 0;      // longest context
  bool attn_padded = false;  // a whole-step graph: the attention covers all T padded rows (graphs.h)
  // Static inputs (device).
  const int32_t* d_cu = nullptr;         // i32 [n+1] cu_seqlens
  const int32_t* d_slots = nullptr;      // i32 [n]
  const int32_t* d_pool_rows = nullptr;  // i32 [T]: pool row of each new token
  // Context inputs (device).
  const int32_t* d_dec_lens = nullptr;  // i32 [nd]
  const int32_t* d_tables = nullptr;    // i32 [n_real, bt_stride]: block tables, padded with page 0
  int64_t bt_stride = 0;
  const int32_t* d_row_lens = nullptr;  // i32 [rows of the real sequences]: visible keys (position + 1)
  const int32_t* d_row_req = nullptr;   // i32 [same]: sequence of the row
  const int32_t* d_iota = nullptr;      // i32 [T+1]: 0, 1, .., T (verify steps: one row's cu_seqlens, speculative.cpp)
  // Image rows (CudaEmbedRows), one group per sequence that has them: n rows from src (device bf16
  // [n, D]) replace the embedding rows d_embed_dst[off .. off + n) of the step (eager steps only).
  struct EmbedRows {
    const uint16_t* src = nullptr;
    int64_t n = 0, off = 0;
  };
  std::vector<EmbedRows> embed_rows;
  const int32_t* d_embed_dst = nullptr;  // i32 [Σ n]: step row of each image row (upload_embed_rows)
};

// The host arrays of a step, built with its BatchStep.
struct BatchInputs {
  std::vector<int32_t> ids, cu{0}, slots, pool_rows, lrows;           // static inputs
  std::vector<int32_t> dec_lens, tables, row_lens, row_req;  // context inputs
  std::vector<int32_t> embed_dst;  // step rows that take image rows (BatchStep::embed_rows)
  bool all_last = true;  // every sequence wants exactly its last logits row
  bool pending = false;  // some ids are run-ahead marks (rows.h pending_id), resolved on the device
};

// Validates `seqs` against `cc` (token ids < V, decodes first, then verify sequences wanting all logits, distinct slots, pages in range, block
// tables covering the contexts) and `embed` (sequences in range, at most one entry each, positions inside
// the sequence and ascending, rows 16-byte aligned); kestrel::Error otherwise. Describes the step.
// n_prev: the ids of the latest sample_ahead, which CudaSeq::prev_id indexes (0: no sequence may have one).
BatchStep describe_batch(std::span<const CudaSeq> seqs, const CudaCache& cc, int64_t V, BatchInputs& in,
                         std::span<const CudaEmbedRows> embed = {}, int64_t n_prev = 0);
// Uploads the context inputs.
void upload_context(Context& x, BatchStep& s, const BatchInputs& in);
// Uploads the static inputs of an eager step; returns the device token ids (the logits rows follow the
// pool rows: s.d_pool_rows + s.T).
const int32_t* upload_inputs(Context& x, BatchStep& s, const BatchInputs& in);
// Uploads the step rows of the image rows (in.embed_dst → s.d_embed_dst); nothing when there are none.
void upload_embed_rows(Context& x, BatchStep& s, const BatchInputs& in);

}  // namespace kestrel::model::gpu

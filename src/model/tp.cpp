// Tensor-parallel plumbing of the CPU layers (see tp.h).
#include "model/tp.h"

#include <cstring>

#include "core/check.h"
#include "parallel/comm.h"

namespace kestrel::model {

int Shard::size() const { return comm ? comm->size() : 1; }
int Shard::rank() const { return comm ? comm->rank() : 0; }

void reduce_to_bf16(const Shard& sh, float* partial, int64_t n, uint16_t* out) {
  if (sh.split()) sh.comm->all_reduce_sum(partial, size_t(n), DType::f32);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(partial[i]);
}

void gather_columns(const Shard& sh, const void* local, int64_t T, int64_t w, DType dt, void* full) {
  const size_t esz = dtype_size(dt), row = size_t(w) * esz;
  const int N = sh.size();
  if (N == 1) {
    std::memcpy(full, local, size_t(T) * row);
    return;
  }
  std::vector<uint8_t> blocks(size_t(N) * size_t(T) * row);  // dt [N, T, w]
  sh.comm->all_gather(local, blocks.data(), size_t(T * w), dt);
  auto* dst = static_cast<uint8_t*>(full);
  for (int p = 0; p < N; ++p)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(dst + (size_t(t) * size_t(N) + size_t(p)) * row, blocks.data() + (size_t(p) * size_t(T) + size_t(t)) * row,
                  row);
}

ModelConfig rank_config(const ModelConfig& c, const ParallelLayout& p) {
  check_layout(c, p);
  ModelConfig r = c;
  TextConfig& t = r.text;
  const int N = p.tp;
  // layout_problems() only demands divisibility of the heads a layer kind actually uses.
  if (t.kda.num_heads % N == 0) t.kda.num_heads /= N;
  if (t.num_attention_heads % N == 0) t.num_attention_heads /= N;
  if (t.index_n_heads % N == 0) t.index_n_heads /= N;
  return r;
}

std::vector<HostBuffer> pack_strided(const ModelConfig& c, ModelWeights& w) {
  std::vector<HostBuffer> out;
  for_each_tensor(c, &w, [&](TensorSpec& s) {
    TensorView& v = *s.dest;
    if (v.empty() || v.is_contiguous()) return;
    const int rank = v.shape.rank;
    KCHECK(rank >= 1 && v.stride[size_t(rank - 1)] == 1, "{}: a strided view without a contiguous last dimension",
           s.name);
    const size_t esz = dtype_size(v.dtype), run = size_t(v.shape[rank - 1]) * esz;
    HostBuffer buf(v.nbytes());
    const int64_t rows = v.shape[rank - 1] == 0 ? 0 : v.numel() / v.shape[rank - 1];
    auto* dst = static_cast<uint8_t*>(buf.data());
    const auto* src = static_cast<const uint8_t*>(v.data);
    for (int64_t k = 0; k < rows; ++k) {
      int64_t rem = k, off = 0;  // element offset of row k (all dims but the last) in the view
      for (int d = rank - 2; d >= 0; --d) {
        off += (rem % v.shape[d]) * v.stride[size_t(d)];
        rem /= v.shape[d];
      }
      std::memcpy(dst + size_t(k) * run, src + size_t(off) * esz, run);
    }
    v = TensorView(buf.data(), v.dtype, v.shape, v.device);
    out.push_back(std::move(buf));
  });
  return out;
}

}  // namespace kestrel::model

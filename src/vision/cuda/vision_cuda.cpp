// MoonViT-V2 forward on the GPU (see vision_cuda.h); the steps and roundings of src/vision/vision.cpp.
#include "vision/cuda/vision_cuda.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rows.h"
#include "kernels/cuda/vision.h"
#include "vision/layers.h"
#include "vision/vision.h"

namespace kestrel::vision {
namespace {

const uint16_t* up(const TensorView& t, std::vector<cuda::DeviceBuffer>& keep) {
  KCHECK(t.dtype == DType::bf16 && t.is_contiguous(), "vision weight: expected contiguous bf16, got {} {}",
         dtype_name(t.dtype), t.shape.str());
  const size_t bytes = size_t(t.numel()) * 2;
  keep.emplace_back(bytes);
  keep.back().copy_from_host(t.data, bytes);
  return static_cast<const uint16_t*>(keep.back().data());
}

}  // namespace

VisionDeviceWeights VisionCuda::upload(const VisionWeights& w, std::vector<cuda::DeviceBuffer>& keep) {
  VisionDeviceWeights d;
  d.patch_embed = up(w.patch_embed, keep);
  d.pos_emb = up(w.pos_emb, keep);
  const uint16_t* p = w.pos_emb.as<const uint16_t>();
  d.pos_host.assign(p, p + w.pos_emb.numel());
  for (const VisionBlockWeights& b : w.blocks)
    d.blocks.push_back({up(b.norm0, keep), up(b.norm1, keep), up(b.wqkv, keep), up(b.wo, keep), up(b.fc0, keep),
                        up(b.fc1, keep)});
  d.final_norm = up(w.final_norm, keep);
  d.proj0 = up(w.proj0, keep);
  d.proj2 = up(w.proj2, keep);
  d.post_norm = up(w.post_norm, keep);
  // Plain cudaMemcpy copies (legacy stream) may still be landing; the encoder runs on streams that do not
  // wait for that stream (see prepare()), so the weights are in place before this returns.
  KCUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

VisionCuda::VisionCuda(const VisionConfig& c, VisionDeviceWeights w) : c_(c), w_(std::move(w)) {
  KCHECK(c_.present, "VisionCuda: the config has no vision tower");
  KCHECK(int64_t(w_.blocks.size()) == c_.num_layers, "VisionCuda: {} blocks, config {}", w_.blocks.size(),
         c_.num_layers);
  KCHECK(int64_t(w_.pos_host.size()) == int64_t(c_.init_pos_emb_height) * c_.init_pos_emb_width * c_.hidden_size,
         "VisionCuda: host position table has {} values", w_.pos_host.size());
  KCHECK(c_.hidden_size % 8 == 0 && c_.qkv_hidden_size % 8 == 0 && c_.text_hidden_size % 8 == 0,
         "VisionCuda: widths must be multiples of 8 (16-byte rows)");
  scratch_.resize(9);
}

uint16_t* VisionCuda::scratch(int i, size_t elems) {
  cuda::DeviceBuffer& b = scratch_[size_t(i)];
  if (b.size() < elems * 2) b = cuda::DeviceBuffer(std::max<size_t>(elems * 2, 256));
  return static_cast<uint16_t*>(b.data());
}

const uint16_t* VisionCuda::pos_for(int gh, int gw, cudaStream_t s) {
  if (gh == c_.init_pos_emb_height && gw == c_.init_pos_emb_width) return w_.pos_emb;
  auto it = pos_.find({gh, gw});
  if (it == pos_.end()) {
    std::vector<uint16_t> host(size_t(gh) * gw * size_t(c_.hidden_size));  // bf16 [gh, gw, Dvt]
    resize_pos_table(w_.pos_host.data(), c_.init_pos_emb_height, c_.init_pos_emb_width, c_.hidden_size, gh, gw,
                     host.data());
    cuda::DeviceBuffer b(host.size() * 2);
    // On `s`, waited for: see prepare() on why a plain cudaMemcpy is not ordered before run()'s kernels.
    KCUDA_CHECK(cudaMemcpyAsync(b.data(), host.data(), host.size() * 2, cudaMemcpyHostToDevice, s));
    KCUDA_CHECK(cudaStreamSynchronize(s));
    it = pos_.emplace(std::make_pair(gh, gw), std::move(b)).first;
  }
  return static_cast<const uint16_t*>(it->second.data());
}

void VisionCuda::encode(std::span<const ImageInput* const> images, uint16_t* out, cudaStream_t s) {
  if (prepare(images, s) > 0) run(out, s);
}

int64_t VisionCuda::prepare(std::span<const ImageInput* const> images, cudaStream_t s) {
  const int64_t P = int64_t(3) * c_.patch_size * c_.patch_size;
  KCHECK(c_.merge_kernel_h == 2 && c_.merge_kernel_w == 2, "VisionCuda: only the 2x2 merge is implemented");
  // The previous call's kernels may still read the index and patch buffers this call rewrites.
  KCUDA_CHECK(cudaStreamSynchronize(s));
  // Host-side plan: row offsets, (row, col) of every patch, merge sources; patches as bf16.
  std::vector<int32_t> rc, msrc;
  row0_.assign(1, 0);
  grids_.clear();
  T_ = tokens_ = max_rows_ = 0;
  for (const ImageInput* im : images) {
    check_image(c_, *im);
    const int64_t n = int64_t(im->grid_h) * im->grid_w;
    for (int64_t t = 0; t < n; ++t) rc.push_back(int32_t(t / im->grid_w)), rc.push_back(int32_t(t % im->grid_w));
    for (int gy = 0; gy < im->grid_h / 2; ++gy)
      for (int gx = 0; gx < im->grid_w / 2; ++gx)
        for (int k = 0; k < 4; ++k)  // TL, TR, BL, BR
          msrc.push_back(int32_t(T_ + int64_t(2 * gy + k / 2) * im->grid_w + (2 * gx + k % 2)));
    T_ += n;
    tokens_ += im->num_tokens();
    max_rows_ = std::max(max_rows_, n);
    KCHECK(T_ < (int64_t(1) << 31), "VisionCuda: {} patches in one call", T_);
    row0_.push_back(int32_t(T_));
    grids_.emplace_back(im->grid_h, im->grid_w);
  }
  if (images.empty()) return 0;
  const size_t n_idx = row0_.size() + rc.size() + msrc.size();
  if (idx_.size() < n_idx * 4) idx_ = cuda::DeviceBuffer(n_idx * 4);
  std::vector<int32_t> all(row0_);
  all.insert(all.end(), rc.begin(), rc.end());
  all.insert(all.end(), msrc.begin(), msrc.end());
  std::vector<uint16_t> hp(size_t(T_ * P));  // pixels enter the BF16 conv rounded (vision.cpp patch_embed)
  int64_t r = 0;
  for (const ImageInput* im : images) {
    cpu::f32_to_bf16_n(im->patches.data(), hp.data() + r * P, int64_t(im->patches.size()));
    r += int64_t(im->grid_h) * im->grid_w;
  }
  // The uploads go on `s` itself and are waited for before returning. A plain cudaMemcpy from pageable
  // memory goes on the legacy default stream and may return before its DMA lands; run()'s kernels on a
  // cudaStreamNonBlocking stream (the model's, so the executor's) are not ordered after it, so the patch
  // embed read the previous call's pixels (and index arrays): the GPU engine's images after its first
  // encoder call came out as the previous call's images at the same rows.
  KCUDA_CHECK(cudaMemcpyAsync(idx_.data(), all.data(), n_idx * 4, cudaMemcpyHostToDevice, s));
  KCUDA_CHECK(cudaMemcpyAsync(scratch(0, hp.size()), hp.data(), hp.size() * 2, cudaMemcpyHostToDevice, s));
  for (const auto& [gh, gw] : grids_) pos_for(gh, gw, s);  // resized tables ready before run()
  // `all` and `hp` die here: the copies must be done (also keeps prepare's "synchronous copies" contract).
  KCUDA_CHECK(cudaStreamSynchronize(s));
  return tokens_;
}

void VisionCuda::run(uint16_t* out, cudaStream_t s) {
  const int64_t Dvt = c_.hidden_size, Fvt = c_.intermediate_size, Wq = c_.qkv_hidden_size, D = c_.text_hidden_size;
  const int64_t M = c_.merged_width(), P = int64_t(3) * c_.patch_size * c_.patch_size;
  const int Hv = c_.num_heads, dv = c_.qkv_hidden_size / c_.num_heads;
  const int64_t T = T_, tokens = tokens_;
  const int n_images = int(grids_.size());
  if (n_images == 0) return;
  const int32_t* d_row0 = static_cast<const int32_t*>(idx_.data());  // i32 [n_images + 1]
  const int32_t* d_rc = d_row0 + row0_.size();                       // i32 [T, 2]
  const int32_t* d_msrc = d_rc + 2 * T;                               // i32 [tokens·4]

  uint16_t* px = scratch(0, size_t(T * P));          // bf16 [T, 3·p·p] (filled by prepare)
  uint16_t* x = scratch(1, size_t(T * Dvt));         // bf16 [T, Dvt], the stream
  uint16_t* h = scratch(2, size_t(T * Dvt));         // bf16 [T, Dvt]
  uint16_t* qkv = scratch(3, size_t(T * 3 * Wq));    // bf16 [T, 3, Hv, dv]
  uint16_t* o = scratch(4, size_t(T * Wq));          // bf16 [T, Hv·dv]
  uint16_t* f = scratch(5, size_t(T * Fvt));         // bf16 [T, Fvt]
  uint16_t* m = scratch(6, size_t(tokens * M));      // bf16 [tokens, 4·Dvt]
  uint16_t* a = scratch(7, size_t(tokens * M));      // bf16 [tokens, 4·Dvt]
  uint16_t* b = scratch(8, size_t(tokens * D));      // bf16 [tokens, D]
  // §6 patch embed: x = bf16(Lin(W_patch)(px) + pos) per image (the table resized to its grid)
  gemm_.bf16(px, P, w_.patch_embed, x, Dvt, T, P, Dvt, s);
  for (int i = 0; i < n_images; ++i) {
    const int64_t r = row0_[size_t(i)], n = row0_[size_t(i) + 1] - r;
    cuda::add_bf16(x + r * Dvt, pos_for(grids_[size_t(i)].first, grids_[size_t(i)].second, s), x + r * Dvt, n * Dvt,
                   s);
  }
  // §6 blocks: x += wo(Attn(RoPE2D(q, k), v)) on RMSNorm0(x); x += fc1(gelu_tanh(fc0(RMSNorm1(x))))
  for (const VisionDeviceWeights::Block& bw : w_.blocks) {
    cuda::rmsnorm_bf16(x, Dvt, bw.norm0, h, Dvt, T, Dvt, c_.rms_norm_eps, s);
    gemm_.bf16(h, Dvt, bw.wqkv, qkv, 3 * Wq, T, Dvt, 3 * Wq, s);
    cuda::vision_rope_qk(qkv, 3 * Wq, Wq, d_rc, T, Hv, dv, s);
    cuda::vision_attention(qkv, 3 * Wq, Wq, d_row0, n_images, max_rows_, Hv, dv, o, Wq, s);
    gemm_.bf16(o, Wq, bw.wo, h, Dvt, T, Wq, Dvt, s);
    cuda::add_bf16(x, h, x, T * Dvt, s);
    cuda::rmsnorm_bf16(x, Dvt, bw.norm1, h, Dvt, T, Dvt, c_.rms_norm_eps, s);
    gemm_.bf16(h, Dvt, bw.fc0, f, Fvt, T, Dvt, Fvt, s);
    cuda::gelu_tanh_bf16(f, T * Fvt, s);
    gemm_.bf16(f, Fvt, bw.fc1, h, Dvt, T, Fvt, Dvt, s);
    cuda::add_bf16(x, h, x, T * Dvt, s);
  }
  // final RMSNorm, 2×2 merge (rows of Dvt gathered into [tokens·4, Dvt] = [tokens, 4·Dvt]), projector
  cuda::rmsnorm_bf16(x, Dvt, w_.final_norm, h, Dvt, T, Dvt, c_.rms_norm_eps, s);
  cuda::copy_rows(h, d_msrc, m, nullptr, tokens * 4, Dvt * 2, s);
  gemm_.bf16(m, M, w_.proj0, a, M, tokens, M, M, s);
  cuda::gelu_erf_bf16(a, tokens * M, s);
  gemm_.bf16(a, M, w_.proj2, b, D, tokens, M, D, s);
  cuda::rmsnorm_bf16(b, D, w_.post_norm, out, D, tokens, D, c_.projector_ln_eps, s);
}

}  // namespace kestrel::vision

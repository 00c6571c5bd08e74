// The CUDA-core paged MLA decode (paged.h: mla_decode_paged_simple): the fallback of the tensor-core decode
// and prefill (mla_decode.cu, mla_prefill.cu) for shapes without a tensor-core instantiation, and the
// benchmark's baseline. The kernels are mla_decode_simple.cuh's, over PagedRows: a key's latent row is read
// from the page arena through its request's block table, and FP8 values are dequantised to their exact bf16
// value e4m3·s, so the math after the load is format-independent (equal to the contiguous reference's).
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/mla_decode_simple.cuh"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }

template <LatentFormat F>
struct PagedRows {
  const uint8_t* arena;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* req;
  int P, C;
  int64_t tb;
  struct Row {
    const uint8_t* arena;
    const int32_t* table;
    int P, C;
    int64_t tb;
    __device__ __forceinline__ uint4 load8(int64_t j, int c8) const {
      const uint8_t* tok = arena + (int64_t(table[j / P]) * P + j % P) * tb;
      if (F == LatentFormat::bf16) return dev::ld16(tok + c8 * 16);
      const int c = c8 * 8;
      if (c < C) {
        const float s = __ldg(reinterpret_cast<const float*>(tok + C + (c / 128) * 4));
        const uint32_t w0 = ld32(tok + c), w1 = ld32(tok + c + 4);
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f[i] = dev::e4m3_to_f32(uint8_t(w0 >> (8 * i))) * s;
          f[4 + i] = dev::e4m3_to_f32(uint8_t(w1 >> (8 * i))) * s;
        }
        return dev::pack8(f);
      }
      const uint8_t* rope = tok + C + ((C + 127) / 128) * 4 + (c - C) * 2;
      return make_uint4(ld32(rope), ld32(rope + 4), ld32(rope + 8), ld32(rope + 12));
    }
  };
  __device__ __forceinline__ Row bind(int b) const {
    return {arena, bt + int64_t(req ? req[b] : b) * bt_stride, P, C, tb};
  }
};

}  // namespace

size_t mla_decode_paged_simple_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  return decode_workspace_bytes(d, B, max_keys);
}

void mla_decode_paged_simple(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b,
                             const PagedMlaCache& c, const MlaPagedBatch& bt, void* workspace, uint16_t* o,
                             cudaStream_t stream) {
  if (bt.B == 0) return;
  KCUDA_REQUIRE(c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla_decode_paged_simple: null cache or block table"));
  KCUDA_REQUIRE(c.C == d.C && c.R == d.R, std::string("mla_decode_paged_simple: cache C/R differ from the layer's"));
  if (c.latent_format == LatentFormat::bf16) {
    const PagedRows<LatentFormat::bf16> rows{c.latent, c.block_tables, c.bt_stride, bt.req, c.block_size,
                                                  int(c.C), c.latent_token_bytes()};
    decode_run(lt, d, q, kv_b, rows, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys, workspace, o, stream);
  } else {
    const PagedRows<LatentFormat::fp8> rows{c.latent, c.block_tables, c.bt_stride, bt.req, c.block_size,
                                                 int(c.C), c.latent_token_bytes()};
    decode_run(lt, d, q, kv_b, rows, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys, workspace, o, stream);
  }
}

}  // namespace kestrel::cuda

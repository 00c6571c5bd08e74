#include "loader/inventory.h"

#include <fmt/format.h>

#include "core/cache_format.h"

namespace kestrel {
namespace {

std::string human(double v, const char* unit) {
  const char* pre[] = {"", "K", "M", "G", "T", "P"};
  int i = 0;
  while (v >= 1000.0 && i < 5) {
    v /= 1000.0;
    ++i;
  }
  return fmt::format("{:.3g} {}{}", v, pre[i], unit);
}

std::string gib(int64_t b) { return fmt::format("{:.2f} GiB", double(b) / double(1ull << 30)); }

}  // namespace

Inventory take_inventory(const ModelConfig& c) {
  Inventory inv;
  const double active_frac = double(c.text.num_experts_per_token) / double(c.text.num_experts);
  double active = 0;
  ModelWeights scratch;
  for_each_tensor(c, &scratch, [&](TensorSpec& s) {
    const int64_t p = logical_params(s);
    const int64_t b = s.shape.numel() * int64_t(dtype_size(s.dtype));
    inv.num_tensors++;
    inv.params[size_t(s.module)] += p;
    inv.bytes[size_t(s.module)] += b;
    inv.total_params += p;
    inv.total_bytes += b;
    const std::string dt = s.module == Module::routed_experts ? "MXFP4" : std::string(dtype_safetensors_name(s.dtype));
    inv.bytes_by_dtype[dt] += b;
    if (s.module == Module::embedding || s.module == Module::vision || s.module == Module::projector) return;
    active += s.module == Module::routed_experts ? double(p) * active_frac : double(p);
  });
  inv.active_params = int64_t(active + 0.5);
  return inv;
}

LayoutMemory layout_memory(const ModelConfig& c, const ParallelLayout& p) {
  LayoutMemory m;
  m.layout = p;
  m.problems = layout_problems(c, p);
  if (!m.problems.empty()) return m;
  ModelWeights scratch;
  for_each_tensor(c, &scratch, [&](TensorSpec& s) {
    const TensorSlice sl = shard_slice(s, c, p);
    const int64_t b = slice_shape(s.shape, sl).numel() * int64_t(dtype_size(s.dtype));
    if (sl.absent) return;
    m.weight_bytes += b;
    if (sl.whole() && !(s.module == Module::routed_experts && p.expert_parallel)) m.replicated_bytes += b;
  });
  const TextConfig& t = c.text;
  // One rank's caches, as the engine's memory plan counts them (cache::CacheLayout::for_rank; the loader
  // cannot link the cache library, tests/unit/test_config.cpp checks both agree): the MLA latent (bf16)
  // and index keys (fp8) have no head dimension, so every TP rank holds them whole unless DCP spreads a
  // page of P tokens as P/DCP rows per rank; the KDA state splits by heads (H/TP per rank).
  m.cache_bytes_per_token = (cache_bytes_per_token(t) + p.dcp - 1) / p.dcp;  // per token, averaged over the page
  const int64_t H = t.kda.num_heads / p.tp, Dk = t.kda.head_dim;
  m.kda_state_bytes = (kda_recurrent_bytes(KdaStateDtype::f32, H, Dk) + kda_conv_bytes(H, Dk, t.kda.conv_size)) *
                      t.num_layers_of(AttnKind::kda);
  return m;
}

std::vector<Platform> reference_platforms() {
  const int64_t h200 = int64_t(139.8 * double(int64_t(1) << 30));
  const int64_t mi355x = int64_t(288) << 30;
  return {{"8 x H200", 8, h200}, {"16 x H200", 16, h200}, {"8 x MI355X", 8, mi355x}};
}

std::vector<std::string> format_layouts(const ModelConfig& c) {
  std::vector<std::string> out;
  const int64_t ctx = c.text.max_position_embeddings;
  std::vector<ParallelLayout> layouts = {{1, 0, false, 1}, {8, 0, false, 1}, {8, 0, true, 1}, {8, 0, true, 8},
                                         {16, 0, true, 1}};
  out.push_back("memory per GPU by parallel layout (rank 0 of each; the loader's sharding rules, docs/parallel.md)");
  std::vector<LayoutMemory> mems;
  for (const ParallelLayout& p : layouts) {
    mems.push_back(layout_memory(c, p));
    const LayoutMemory& m = mems.back();
    if (!m.problems.empty()) {
      out.push_back(fmt::format("layout {:<12} cannot split this model: {}", p.name(), m.problems.front()));
      continue;
    }
    out.push_back(fmt::format("layout {:<12} weights {} B = {}{}; MLA cache {} B/token; KDA state {} B = {:.1f} "
                              "MiB/request",
                              p.name(), m.weight_bytes, gib(m.weight_bytes),
                              p.tp > 1 ? fmt::format(" (replicated {})", gib(m.replicated_bytes)) : "",
                              m.cache_bytes_per_token, m.kda_state_bytes, double(m.kda_state_bytes) / (1 << 20)));
  }
  out.push_back(fmt::format("fit: weights + {} runtime reserve + one {}-token request (KDA state + MLA cache) per GPU",
                            gib(kRuntimeReserveBytes), ctx));
  for (const Platform& pf : reference_platforms()) {
    for (const LayoutMemory& m : mems) {
      const ParallelLayout& p = m.layout;
      if (p.tp == 1 || !m.problems.empty()) continue;
      std::string verdict;
      if (pf.gpus % p.tp != 0) {
        verdict = fmt::format("n/a ({} ranks)", p.tp);
      } else {
        const int64_t free = pf.bytes_per_gpu - m.weight_bytes - kRuntimeReserveBytes;
        const int64_t one = m.kda_state_bytes + m.cache_bytes_per_token * ctx;
        if (free >= one)
          verdict = fmt::format("fits: {} free for caches = {} tokens of MLA cache", gib(free),
                                (free - m.kda_state_bytes) / std::max<int64_t>(m.cache_bytes_per_token, 1));
        else if (free >= 0)
          verdict = fmt::format("no: {} free, one full-context request needs {}", gib(free), gib(one));
        else
          verdict = fmt::format("no: weights + reserve exceed the GPU by {}", gib(-free));
      }
      out.push_back(fmt::format("fit {:<11} {:<12} {}", pf.name, p.name(), verdict));
    }
  }
  return out;
}

int64_t kda_state_bytes_per_request(const TextConfig& t) {
  const int64_t H = t.kda.num_heads, Dk = t.kda.head_dim;
  return (kda_recurrent_bytes(KdaStateDtype::f32, H, Dk) + kda_conv_bytes(H, Dk, t.kda.conv_size)) *
         t.num_layers_of(AttnKind::kda);
}

int64_t cache_bytes_per_token(const TextConfig& t) {
  const int64_t latent = latent_token_bytes(LatentFormat::bf16, t.kv_lora_rank, t.qk_rope_head_dim);
  const int64_t index = t.has_indexer() ? index_key_token_bytes(IndexKeyFormat::fp8, t.index_head_dim) : 0;
  return (latent + index) * t.num_layers_of(AttnKind::mla);
}

std::string format_inventory(const ModelConfig& c, const Inventory& inv) {
  const TextConfig& t = c.text;
  std::string s;
  auto line = [&](const std::string& l) { s += l + "\n"; };
  line(fmt::format("model_type        {}", c.model_type.empty() ? "(bare text config)" : c.model_type));
  line(fmt::format("layers            {} ({} KDA, {} MLA; {} dense MLP, {} MoE)", t.num_hidden_layers,
                   t.num_layers_of(AttnKind::kda), t.num_layers_of(AttnKind::mla), t.num_layers_of(MlpKind::dense),
                   t.num_layers_of(MlpKind::moe)));
  std::string kinds;
  for (int i = 0; i < t.num_hidden_layers; ++i) kinds += t.attn_kind[size_t(i)] == AttnKind::mla ? 'M' : 'K';
  line(fmt::format("layer pattern     {}", kinds));
  line(fmt::format("hidden / vocab    {} / {}", t.hidden_size, t.vocab_size));
  line(fmt::format("KDA               {} heads x {} (conv {})", t.kda.num_heads, t.kda.head_dim, t.kda.conv_size));
  line(fmt::format("MLA               {} heads, q_lora {}, kv_lora {}, nope/rope/v {}/{}/{}, gate {}",
                   t.num_attention_heads, t.q_lora_rank, t.kv_lora_rank, t.qk_nope_head_dim, t.qk_rope_head_dim,
                   t.v_head_dim, t.mla_use_output_gate));
  if (t.has_indexer())
    line(fmt::format("DSA indexer       {} heads x {}, top-{}{}", t.index_n_heads, t.index_head_dim, t.index_topk,
                     t.index_rope_head_dim ? fmt::format(", rope {}", t.index_rope_head_dim) : ", NoPE"));
  else
    line("DSA indexer       none");
  line(fmt::format("MoE               {} experts, top-{}, latent {}, intermediate {}, {} shared ({} wide)",
                   t.num_experts, t.num_experts_per_token, t.routed_expert_hidden_size, t.moe_intermediate_size,
                   t.num_shared_experts, t.shared_intermediate()));
  line(fmt::format("dense MLP         {}", t.intermediate_size));
  line(fmt::format("AttnRes           block {}, {} stored blocks", t.attn_res_block_size, t.num_attn_res_blocks()));
  if (c.vision.present)
    line(fmt::format("vision            {} layers, width {}, {} heads", c.vision.num_layers, c.vision.hidden_size,
                     c.vision.num_heads));
  line("");
  line(fmt::format("{:<16} {:>18} {:>14}", "module", "parameters", "bytes"));
  for (size_t m = 0; m < size_t(Module::count_); ++m) {
    if (inv.params[m] == 0 && inv.bytes[m] == 0) continue;
    line(fmt::format("{:<16} {:>18} {:>14}", module_name(Module(m)), inv.params[m], gib(inv.bytes[m])));
  }
  line(fmt::format("{:<16} {:>18} {:>14}", "total", inv.total_params, gib(inv.total_bytes)));
  line("");
  line(fmt::format("total parameters  {} ({})", inv.total_params, human(double(inv.total_params), "")));
  line(fmt::format("active parameters {} ({}) per token: routed experts at {}/{}, input embedding and vision "
                   "excluded",
                   inv.active_params, human(double(inv.active_params), ""), t.num_experts_per_token, t.num_experts));
  line(fmt::format("tensors           {}", inv.num_tensors));
  std::string dts;
  for (const auto& [dt, b] : inv.bytes_by_dtype) dts += fmt::format("{} {}  ", dt, gib(b));
  line(fmt::format("bytes by dtype    {}", dts));
  line("");
  line(fmt::format("KDA state         {} per request (f32 recurrent + bf16 conv, {} layers)",
                   gib(kda_state_bytes_per_request(t)), t.num_layers_of(AttnKind::kda)));
  line(fmt::format("MLA caches        {} bytes per token (bf16 latent {} + fp8 index key, {} layers)",
                   cache_bytes_per_token(t), t.mla_cache_width(), t.num_layers_of(AttnKind::mla)));
  line("");
  for (const std::string& l : format_layouts(c)) line(l);
  return s;
}

}  // namespace kestrel

#include "loader/inventory.h"

#include <fmt/format.h>

#include "core/cache_format.h"

namespace kestrel {
namespace {

bool is_sharded(const TensorSpec& s) {
  switch (s.module) {
    case Module::embedding:
    case Module::lm_head:
    case Module::kda:
    case Module::dense_mlp:
    case Module::routed_experts:
    case Module::shared_experts:
      return true;
    case Module::mla: {
      // q_a_proj, kv_a_proj and their norms feed every head: replicated.
      const std::string_view n = s.name;
      return !(n.find("q_a_") != n.npos || n.find("kv_a_") != n.npos);
    }
    default:
      return false;
  }
}

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
    (is_sharded(s) ? inv.sharded_bytes : inv.replicated_bytes) += b;
    if (s.module == Module::embedding || s.module == Module::vision || s.module == Module::projector) return;
    active += s.module == Module::routed_experts ? double(p) * active_frac : double(p);
  });
  inv.active_params = int64_t(active + 0.5);
  return inv;
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
  line("weights per GPU   (sharded: heads, FFN, vocab, experts; replicated: norms, router, latent, q_a/kv_a, "
       "indexer, vision)");
  for (int tp : {1, 8, 16})
    line(fmt::format("  TP={:<3}          {}", tp, gib(inv.bytes_per_gpu(tp))));
  return s;
}

}  // namespace kestrel

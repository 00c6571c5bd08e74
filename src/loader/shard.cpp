// Sharding rules and shard binding; the rules themselves are listed in shard.h and argued in
// docs/parallel.md. Everything here is arithmetic on names and shapes: no tensor byte is read.
#include "loader/shard.h"

#include <charconv>

#include "core/check.h"
#include "loader/safetensors.h"

namespace kestrel {

std::string ParallelLayout::name() const {
  std::string s = fmt::format("TP{}", tp);
  if (expert_parallel) s += fmt::format("+EP{}", tp);
  if (dcp > 1) s += fmt::format("+DCP{}", dcp);
  return s;
}

std::vector<std::string> layout_problems(const ModelConfig& c, const ParallelLayout& p) {
  std::vector<std::string> out;
  if (p.tp < 1) out.push_back(fmt::format("tensor-parallel size must be >= 1, got {}", p.tp));
  if (p.rank < 0 || p.rank >= std::max(p.tp, 1))
    out.push_back(fmt::format("rank {} is outside [0, {})", p.rank, p.tp));
  if (p.dcp < 1) out.push_back(fmt::format("decode-context-parallel size must be >= 1, got {}", p.dcp));
  else if (p.tp >= 1 && p.tp % p.dcp != 0)
    out.push_back(fmt::format("decode-context-parallel size {} must divide the tensor-parallel size {} (DCP ranks are "
                              "ranks of the TP group)",
                              p.dcp, p.tp));
  if (p.tp <= 1) return out;
  const TextConfig& t = c.text;
  const int N = p.tp;
  auto need = [&](int64_t value, const char* field, const char* what) {
    if (value % N != 0)
      out.push_back(fmt::format("text_config.{} = {} ({}) does not divide by tensor-parallel size {}", field, value,
                                what, N));
  };
  if (t.num_layers_of(AttnKind::kda) > 0) need(t.kda.num_heads, "linear_attn_config.num_heads", "KDA heads");
  if (t.num_layers_of(AttnKind::mla) > 0) {
    need(t.num_attention_heads, "num_attention_heads", "MLA heads");
    if (t.has_indexer()) need(t.index_n_heads, "index_n_heads", "indexer heads");
  }
  need(t.vocab_size, "vocab_size", "vocabulary rows of embed_tokens and lm_head");
  if (t.num_layers_of(MlpKind::dense) > 0) need(t.intermediate_size, "intermediate_size", "dense MLP width");
  if (t.num_layers_of(MlpKind::moe) > 0) {
    need(t.num_experts, "num_experts", p.expert_parallel ? "experts per rank and router rows" : "router rows");
    need(t.routed_expert_hidden_size, "routed_expert_hidden_size", "latent width");
    if (t.num_shared_experts > 0) need(t.shared_intermediate(), "shared experts width", "shared-expert width");
    if (!p.expert_parallel) {
      const int64_t I = t.moe_intermediate_size;
      if (I % N != 0)
        need(I, "moe_intermediate_size", "expert intermediate width");
      else if ((I / N) % kMxBlock != 0)
        out.push_back(fmt::format("text_config.moe_intermediate_size = {} split {} ways gives {} columns per rank, not a "
                                  "multiple of the {}-element MXFP4 block (use --enable-expert-parallel)",
                                  I, N, I / N, kMxBlock));
    }
  }
  return out;
}

void check_layout(const ModelConfig& c, const ParallelLayout& p) {
  const std::vector<std::string> problems = layout_problems(c, p);
  if (problems.empty()) return;
  std::string msg = fmt::format("cannot run this model as {} ({} problem{}):", p.name(), problems.size(),
                                problems.size() == 1 ? "" : "s");
  for (const auto& s : problems) msg += "\n  - " + s;
  throw Error(msg);
}

namespace {

// Global expert id E of ".experts.E." in a routed-expert tensor name.
int64_t expert_id(std::string_view name) {
  const size_t at = name.rfind(".experts.");
  KCHECK(at != name.npos, "'{}' is not a routed-expert tensor", name);
  const char* b = name.data() + at + 9;
  int64_t e = -1;
  const auto r = std::from_chars(b, name.data() + name.size(), e);
  KCHECK(r.ec == std::errc() && *r.ptr == '.', "no expert id in '{}'", name);
  return e;
}

}  // namespace

TensorSlice shard_slice(const TensorSpec& s, const ModelConfig& c, const ParallelLayout& p) {
  if (p.tp <= 1) return {};
  const TextConfig& t = c.text;
  const int64_t N = p.tp, r = p.rank;
  auto part = [&](int dim, int64_t n) { return TensorSlice{dim, n / N * r, n / N * (r + 1), false}; };
  auto rows = [&] { return part(0, s.shape[0]); };
  auto cols = [&] { return part(1, s.shape[1]); };
  const std::string_view n = s.name;
  auto is = [&](std::string_view suffix) { return n.ends_with(suffix); };
  switch (s.module) {
    case Module::embedding:
    case Module::lm_head:
      return rows();  // vocabulary
    case Module::kda:
      if (is(".f_a_proj.weight") || is(".o_norm.weight")) return {};
      if (is(".o_proj.weight")) return cols();
      if (is(".A_log")) return part(0, t.kda.num_heads);  // the first H entries; the padding is never used
      return rows();  // q/k/v/g_proj, conv weights, f_b_proj, b_proj, dt_bias: heads
    case Module::mla:
      if (is(".q_a_proj.weight") || is(".q_a_layernorm.weight") || is(".kv_a_proj_with_mqa.weight") ||
          is(".kv_a_layernorm.weight"))
        return {};
      if (is(".o_proj.weight")) return cols();
      return rows();  // q_b_proj, kv_b_proj, g_proj: heads
    case Module::indexer:
      if (is(".wq_b.weight") || is(".weights_proj.weight")) return rows();  // indexer heads
      return {};                                                             // wk, k_norm: one key per token
    case Module::dense_mlp:
    case Module::shared_experts:
      return is(".down_proj.weight") ? cols() : rows();
    case Module::router:
      return rows();  // experts
    case Module::latent_proj:
      return is(".routed_expert_up_proj.weight") ? cols() : rows();  // latent width Lt
    case Module::routed_experts: {
      if (p.expert_parallel) {
        const int64_t X = t.num_experts, e = expert_id(n);
        const bool mine = e >= X / N * r && e < X / N * (r + 1);
        return mine ? TensorSlice{} : TensorSlice{-1, 0, 0, true};
      }
      // Intermediate split: w1/w3 [I, *] by rows; w2 [Lt, I/2] packed and [Lt, I/32] scales by columns,
      // which cut I at the same place because (I / N) is a multiple of 32.
      return n.find(".w2.") != n.npos ? cols() : rows();
    }
    default:
      return {};  // norms, vision, projector
  }
}

Shape slice_shape(const Shape& full, const TensorSlice& sl) {
  if (sl.absent) return Shape{};
  if (sl.dim < 0) return full;
  Shape s = full;
  s.d[size_t(sl.dim)] = sl.end - sl.begin;
  return s;
}

TensorView slice_view(const TensorView& full, const TensorSlice& sl) {
  if (sl.absent) return TensorView{};
  if (sl.dim < 0) return full;
  KCHECK(full.is_contiguous(), "slice_view wants a contiguous tensor");
  KCHECK(sl.dim < full.shape.rank && sl.begin >= 0 && sl.begin <= sl.end && sl.end <= full.shape[sl.dim],
         "slice [{}, {}) of dim {} outside shape {}", sl.begin, sl.end, sl.dim, full.shape.str());
  TensorView v = full;  // keeps the full tensor's strides: a column slice steps over the other columns
  v.shape.d[size_t(sl.dim)] = sl.end - sl.begin;
  v.data = static_cast<uint8_t*>(full.data) +
           size_t(sl.begin) * size_t(full.stride[size_t(sl.dim)]) * dtype_size(full.dtype);
  return v;
}

ModelWeights bind_shard(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& p) {
  check_layout(c, p);
  // Full-tensor views first (every name, dtype and shape checked against the config; nothing read),
  // then each view is narrowed to this rank's slice.
  ModelWeights w = bind_weights(c, ckpt);
  if (p.tp <= 1) return w;
  for_each_tensor(c, &w, [&](TensorSpec& s) {
    if (!s.dest->empty()) *s.dest = slice_view(*s.dest, shard_slice(s, c, p));
  });
  if (c.text.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace kestrel

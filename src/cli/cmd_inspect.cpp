// `kestrel inspect DIR [--config-only] [--tensor-parallel-size N [--enable-expert-parallel]
// [--decode-context-parallel-size N]]`: config summary, parameter counts, memory per GPU under the
// reference layouts (TP8, TP8+EP8, TP16+EP16, ...) and whether each fits 8 x H200, 16 x H200 and
// 8 x MI355X. Without --config-only the checkpoint is opened and every tensor is validated and bound,
// so a clean run of inspect means the directory will load. With --tensor-parallel-size the layout is
// checked against the config (one error listing every count that does not divide) and, with a
// checkpoint, every rank's shard is bound (views into the mapped files) and its bytes reported.
#include <fmt/format.h>

#include <memory>

#include "cache/layout.h"
#include "cli/commands.h"
#include "core/cache_format.h"
#include "loader/config.h"
#include "loader/inventory.h"
#include "loader/safetensors.h"
#include "loader/shard.h"
#include "loader/weights.h"

namespace kestrel::cli {

void register_inspect(CLI::App& app) {
  struct Opts {
    std::string dir;
    bool config_only = false;
    int tp = 1;
    bool ep = false;
    int dcp = 1;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("inspect", "Summarise a checkpoint: config, parameters, memory per GPU");
  cmd->add_option("dir", opts->dir, "checkpoint directory (or config.json with --config-only)")->required();
  cmd->add_flag("--config-only", opts->config_only, "work from config.json alone; do not open the shards");
  cmd->add_option("--tensor-parallel-size,--tp", opts->tp, "check (and bind) this tensor-parallel layout")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--enable-expert-parallel", opts->ep, "whole experts per rank (EP size = TP size)");
  cmd->add_option("--decode-context-parallel-size,--dcp", opts->dcp, "ranks a request's MLA cache is spread over")
      ->check(CLI::PositiveNumber);
  cmd->callback([opts] {
    const ModelConfig cfg = load_config(opts->dir);
    const Inventory inv = take_inventory(cfg);
    fmt::print("{}", format_inventory(cfg, inv));
    const ParallelLayout layout{opts->tp, 0, opts->ep, opts->dcp};
    const bool parallel = opts->tp > 1 || opts->ep || opts->dcp > 1;
    if (parallel) {
      check_layout(cfg, layout);
      const LayoutMemory m = layout_memory(cfg, layout);
      fmt::print("\nlayout {}: {} B of weights per rank ({} B replicated), MLA cache {} B/token, KDA state {} B/request\n",
                 layout.name(), m.weight_bytes, m.replicated_bytes, m.cache_bytes_per_token, m.kda_state_bytes);
      // The engine's memory plan for one rank (sched/memory_plan.h), in the deployment formats.
      const CacheFormats f{128, LatentFormat::bf16, IndexKeyFormat::fp8, KdaStateDtype::f32};
      const cache::CacheLayout rl = cache::CacheLayout::for_rank(cfg.text, f, layout.tp, layout.dcp);
      fmt::print("caches per rank   KDA state split by heads ({} of {} per rank); MLA latent and index keys "
                 "{} (a {}-token page is {} rows per rank)\n"
                 "                  {}\n",
                 cfg.text.kda.num_heads / layout.tp, cfg.text.kda.num_heads,
                 layout.dcp > 1 ? fmt::format("spread along tokens over DCP{}", layout.dcp)
                                : std::string("replicated on every TP rank"),
                 f.block_size, rl.block_size, rl.describe());
    }
    if (opts->config_only) return;
    const Checkpoint ckpt(opts->dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    fmt::print("\ncheckpoint        {} file(s), {} tensors, all bound and shape-checked\n", ckpt.num_files(),
               ckpt.tensors().size());
    if (!parallel) return;
    for (int r = 0; r < opts->tp; ++r) {
      ParallelLayout p = layout;
      p.rank = r;
      ModelWeights shard = bind_shard(cfg, ckpt, p);
      int64_t bytes = 0, tensors = 0;
      for_each_tensor(cfg, &shard, [&](TensorSpec& s) {
        if (s.dest->empty()) return;
        bytes += int64_t(s.dest->nbytes());
        ++tensors;
      });
      fmt::print("shard {} rank {:<3} {} tensors bound, {} B (views into the mapped shards)\n", layout.name(), r,
                 tensors, bytes);
    }
  });
}

}  // namespace kestrel::cli

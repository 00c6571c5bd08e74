// `kestrel inspect DIR [--config-only]`: config summary, parameter counts, memory per GPU.
// Without --config-only the checkpoint is opened and every tensor is validated and bound, so a
// clean run of inspect means the directory will load.
#include <fmt/format.h>

#include <memory>

#include "cli/commands.h"
#include "loader/config.h"
#include "loader/inventory.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

namespace kestrel::cli {

void register_inspect(CLI::App& app) {
  struct Opts {
    std::string dir;
    bool config_only = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("inspect", "Summarise a checkpoint: config, parameters, memory per GPU");
  cmd->add_option("dir", opts->dir, "checkpoint directory (or config.json with --config-only)")->required();
  cmd->add_flag("--config-only", opts->config_only, "work from config.json alone; do not open the shards");
  cmd->callback([opts] {
    const ModelConfig cfg = load_config(opts->dir);
    const Inventory inv = take_inventory(cfg);
    fmt::print("{}", format_inventory(cfg, inv));
    if (opts->config_only) return;
    const Checkpoint ckpt(opts->dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    fmt::print("\ncheckpoint        {} file(s), {} tensors, all bound and shape-checked\n", ckpt.num_files(),
               ckpt.tensors().size());
  });
}

}  // namespace kestrel::cli

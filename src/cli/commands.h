// Subcommands of the `kestrel` binary. Each registers itself on the CLI11 app; main() owns error
// handling so every subcommand may simply throw kestrel::Error. `serve` and `generate` share their
// engine flags (engine_flags.h) and get their engine from the engine layer (runtime/engine_host.h).
#pragma once

#include <CLI/CLI.hpp>

namespace kestrel::cli {

void register_inspect(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_serve(CLI::App& app);
void register_bench(CLI::App& app);
void register_eval(CLI::App& app);

}  // namespace kestrel::cli

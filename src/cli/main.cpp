// `kestrel`: one binary, many subcommands (inspect, generate, serve, bench, eval, ...).
//
// Every failure of outside input reaches here as a kestrel::Error and becomes one line on stderr
// and exit status 1; usage errors exit 2 as CLI11 decides. Nothing is allowed to abort.
#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/check.h"

int main(int argc, char** argv) {
  CLI::App app{"kestrel: inference engine for Kimi K3.1 Pro"};
  app.require_subcommand(1);
  kestrel::cli::register_inspect(app);
  kestrel::cli::register_generate(app);
  kestrel::cli::register_tokenize(app);
  kestrel::cli::register_serve(app);
  kestrel::cli::register_bench(app);
  kestrel::cli::register_eval(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kestrel::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}

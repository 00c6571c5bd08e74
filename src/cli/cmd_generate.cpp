// `kestrel generate`: text generation through the serving engine (runtime/engine.h): the scheduler,
// paged caches and sampler that `kestrel serve` uses, on the CPU or the GPU, for checking a
// checkpoint end to end and for small-model benchmarks.
//
//   kestrel generate (--prompt-tokens 1,2,3 | --prompt TEXT | --prompts-file FILE) --max-tokens N
//                    [sampling flags] [--stop S] [--stop-token-id ID] [--ignore-eos] [--logprobs N]
//                    [--dump-logits FILE] [--image FILE ...] [engine flags: cli/engine_flags.h]
//
// The engine comes from the engine layer (runtime/engine_host.h) with the flags `serve` takes;
// output text goes through the server's text stream (tokenizer/text_stream.h), so detokenisation,
// stop strings and what ends a request (request.h) are the server's. The checkpoint's tokenizer is
// loaded when it has one (text prompts and --stop need it): its end-of-turn specials stop generation
// unless --ignore-eos, and the text is printed.
//
// Prints the memory plan (capacity in tokens, concurrent requests, longest single request), then
// per request the generated ids (and text with a tokenizer), then throughput. A single prompt prints
// "tokens:", "prompt tokens:", "text:", "finish:", "prefill:", "decode:"; several prompts
// (--prompts-file: one per line, text or `ids:1,2,3`; blank lines and lines starting with '#'
// skipped) run concurrently and print "[i] ..." lines (with --logprobs, "[i] logprobs: ..." per token)
// plus aggregate throughput.
// --dump-logits (single prompt only) writes every position fed through the model (prompt, then each
// generated token but the last) as a NumPy .npy v1.0 file: magic "\x93NUMPY", version 1 0, u16
// little-endian header length, an ASCII dict {'descr': '<f4', 'fortran_order': False, 'shape':
// (positions, vocab), } padded with spaces and a final '\n' so the data starts at a multiple of 64
// bytes, then the row-major little-endian float32 logits.
// Text prompts are encoded as plain text: special-token text in them stays ordinary text.
// --image FILE (repeatable, with --prompt-tokens): each image is decoded and preprocessed as the
// server does it and fills the next run of the prompt's <|media_pad|> ids (its grid's token count of
// them, consecutive); counts that do not match are an error naming them. --dump-logits covers such
// prompts like any other.
#include <fmt/format.h>

#include <bit>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/cache_format.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "core/check.h"
#include "loader/config.h"
#include "runtime/engine_host.h"
#include "tokenizer/text_stream.h"
#include "tokenizer/tokenizer.h"
#include "vision/image.h"

namespace kestrel::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      fail("--prompt-tokens: '{}' is not an integer", item);
    }
    if (used != item.size() || v < 0 || v > INT32_MAX) fail("--prompt-tokens: '{}' is not a token id", item);
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) fail("--prompt-tokens is empty");
  return ids;
}

void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols);
  const size_t prefix = 10;  // magic(6) + version(2) + header length(2)
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) fail("{}: cannot open for writing", path);
  const uint16_t hl = uint16_t(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {char(hl & 0xFF), char(hl >> 8)};
  out.write(len, 2);
  out.write(header.data(), std::streamsize(header.size()));
  static_assert(std::endian::native == std::endian::little, "npy writer assumes a little-endian host");
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(float)));
  if (!out) fail("{}: write failed", path);
}

struct GenerateOpts {
  EngineFlags engine;
  std::string prompt_tokens, prompt, prompts_file, dump_logits;
  int max_tokens = 16, top_k = 0, logprobs = -1;
  float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f, repetition_penalty = 1.0f, presence_penalty = 0.0f,
        frequency_penalty = 0.0f;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false, quiet = false;
  std::vector<std::string> images;  // --image FILE (repeatable)
  int64_t max_image_pixels = 50'000'000;
};

// --image files, decoded and preprocessed as the server does (vision/image.h), placed at the prompt's
// <|media_pad|> positions in order. The pad id: the tokenizer's <|media_pad|>, else config.json's
// media_placeholder_token_id (MODEL.md §6).
struct Images {
  std::vector<std::shared_ptr<const ImageInput>> inputs;
  std::vector<MediaSpan> media;
};
Images load_images(const GenerateOpts& o, const tok::Tokenizer* tk, std::span<const int32_t> prompt) {
  const ModelConfig cfg = load_config(o.engine.model);
  if (!cfg.vision.present)
    fail("--image: the checkpoint has no vision tower (its config.json has no vision_config)");
  int32_t pad = cfg.media_placeholder_token_id;
  if (tk)
    if (auto id = tk->special_id("<|media_pad|>")) pad = int32_t(*id);
  if (pad < 0) fail("--image: no <|media_pad|> id (neither the tokenizer nor config.json's media_placeholder_token_id)");
  const vision::PreprocessConfig pc = vision::load_preprocess_config(o.engine.model);
  Images out;
  for (const std::string& path : o.images) {
    std::ifstream f(path, std::ios::binary);
    if (!f) fail("--image {}: cannot open", path);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    try {
      const vision::LoadedImage li = vision::load_image(bytes, {o.max_image_pixels}, pc);
      fmt::print("image {}: {} {}x{} -> grid {}x{} patches, {} tokens\n", out.inputs.size(), path, li.width, li.height,
                 li.input->grid_h, li.input->grid_w, li.input->num_tokens());
      out.inputs.push_back(li.input);
    } catch (const Error& e) {
      fail("--image {}: {}", path, e.what());
    }
  }
  out.media = vision::place_images(prompt, pad, out.inputs);
  for (size_t i = 0; i < out.media.size(); ++i)
    fmt::print("image {}: prompt positions [{}, {})\n", i, out.media[i].start, out.media[i].end);
  return out;
}

struct Prompt {
  std::vector<int32_t> ids;
  bool text = false;
};

// Prompts from --prompt, --prompt-tokens or --prompts-file (text needs the tokenizer).
std::vector<Prompt> read_prompts(const GenerateOpts& o, const tok::Tokenizer* tk) {
  auto encode = [&](const std::string& text, const std::string& what) {
    if (!tk) fail("{}: the checkpoint has no tokenizer (tiktoken.model) to encode text", what);
    Prompt p{{}, true};
    for (tok::TokenId id : tk->encode(text, /*allow_special=*/false)) p.ids.push_back(int32_t(id));
    if (p.ids.empty()) fail("{} encodes to no tokens", what);
    return p;
  };
  std::vector<Prompt> prompts;
  if (!o.prompt.empty()) {
    prompts.push_back(encode(o.prompt, "--prompt"));
  } else if (!o.prompt_tokens.empty()) {
    prompts.push_back({parse_ids(o.prompt_tokens), false});
  } else {
    std::ifstream in(o.prompts_file);
    if (!in) fail("{}: cannot open", o.prompts_file);
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (line.empty() || line[0] == '#') continue;
      if (line.rfind("ids:", 0) == 0)
        prompts.push_back({parse_ids(line.substr(4)), false});
      else
        prompts.push_back(encode(line, fmt::format("{} line {}", o.prompts_file, lineno)));
    }
    if (prompts.empty()) fail("{}: no prompts", o.prompts_file);
  }
  return prompts;
}

// One request's output as it arrives on the engine thread.
struct Result {
  std::vector<int32_t> tokens;
  std::vector<std::string> logprob_lines;
  std::optional<tok::TextStream> text;  // with a tokenizer
  std::string finish, error;
  double first_token_s = 0, done_s = 0;
  bool done = false;
};

// Shared with the sinks (which may outlive this command's stack while the engine shuts down).
struct Run {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Result> results;
  std::vector<float> dumped;  // f32 [positions, V]
  size_t finished = 0;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double since_start() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

void on_event(Run& run, size_t i, runtime::Engine& engine, bool logprobs, TokenEvent&& ev) {
  std::lock_guard<std::mutex> lk(run.mu);
  Result& res = run.results[i];
  const bool cut = res.text && res.text->stop_matched();  // after a stop string only the end counts
  if (ev.token >= 0 && !cut) {
    if (res.tokens.empty()) res.first_token_s = run.since_start();
    res.tokens.push_back(ev.token);
    if (logprobs) {
      std::string line = fmt::format("{} ({:.4f})", ev.token, ev.logprob);
      for (const auto& t : ev.top_logprobs) line += fmt::format(" {}:{:.4f}", t.token, t.logprob);
      res.logprob_lines.push_back(line);
    }
    if (res.text && ev.finish != FinishReason::stop) {
      res.text->push(tok::TokenId(ev.token));
      if (res.text->stop_matched() && !ev.finished()) engine.cancel(ev.id);
    }
  }
  if (!ev.finished()) return;
  if (res.text && !res.text->done() && (ev.finish == FinishReason::stop || ev.finish == FinishReason::length))
    res.text->finish(ev.finish == FinishReason::length ? tok::FinishCause::kLength : tok::FinishCause::kStop);
  res.finish = res.text && res.text->stop_matched() ? "stop" : finish_reason_name(ev.finish);
  res.error = ev.error;
  res.done_s = run.since_start();
  res.done = true;
  ++run.finished;
  run.cv.notify_all();
}

void generate(const GenerateOpts& o) {
  if (int(!o.prompt_tokens.empty()) + int(!o.prompt.empty()) + int(!o.prompts_file.empty()) != 1)
    fail("give exactly one of --prompt-tokens, --prompt or --prompts-file");
  std::optional<tok::Tokenizer> tokenizer;
  if (std::filesystem::exists(std::filesystem::path(o.engine.model) / "tiktoken.model"))
    tokenizer = tok::Tokenizer::load(o.engine.model);
  else if (!o.stop.empty())
    fail("--stop needs the checkpoint's tokenizer (tiktoken.model)");
  const tok::Tokenizer* tk = tokenizer ? &*tokenizer : nullptr;
  const std::vector<Prompt> prompts = read_prompts(o, tk);
  const bool dump = !o.dump_logits.empty();
  if (dump && prompts.size() != 1) fail("--dump-logits works with a single prompt only");
  Images images;
  if (!o.images.empty()) {
    if (o.prompt_tokens.empty()) fail("--image needs --prompt-tokens (whose <|media_pad|> positions receive the images)");
    images = load_images(o, tk, prompts[0].ids);
  }

  runtime::EngineOptions eo = o.engine.options(int(std::min<size_t>(prompts.size(), 16)));
  eo.tokenizer = tk;
  if (runtime::run_mpi_rank(eo)) return;  // under mpirun: ranks > 0 executed rank 0's steps (executor_mpi.h)
  runtime::EngineHost host(eo);
  if (!host.wait_loaded()) fail("{}", host.load_error());
  runtime::Engine& engine = host.engine();
  const int64_t V = engine.vocab_size();
  fmt::print("memory plan ({} latent, {} index keys, {} KDA state):\n{}\n", o.engine.kv_cache_dtype,
             o.engine.index_cache_dtype, format_name(eo.engine.formats.kda_state), engine.memory_plan().describe());

  // Every request is checked before any runs, so a bad one fails the command with nothing in flight.
  std::vector<Request> requests(prompts.size());
  auto run = std::make_shared<Run>();
  run->results.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request& r = requests[i];
    r.prompt = prompts[i].ids;
    r.max_tokens = o.max_tokens;
    SamplingParams& s = r.sampling;
    s.temperature = o.temperature, s.top_p = o.top_p, s.top_k = o.top_k, s.min_p = o.min_p;
    s.repetition_penalty = o.repetition_penalty, s.presence_penalty = o.presence_penalty;
    s.frequency_penalty = o.frequency_penalty, s.seed = o.seed + i, s.logprobs = o.logprobs;
    r.stop = o.stop;
    r.stop_token_ids = o.stop_token_ids;
    r.ignore_eos = o.ignore_eos;
    r.media = images.media;
    r.images = images.inputs;
    if (dump)
      r.on_logits = [run](int64_t, std::span<const float> row) { run->dumped.insert(run->dumped.end(), row.begin(), row.end()); };
    validate(r, engine.limits());
    if (tk) run->results[i].text = tok::TextStream::plain(*tk, r.stop);
  }
  run->t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const bool lp = o.logprobs >= 0;
    const Submission s = engine.submit(std::move(requests[i]), [run, i, &engine, lp](TokenEvent&& ev) {
      on_event(*run, i, engine, lp, std::move(ev));
    });
    if (!s.accepted()) fail("the engine refused request {} ({})", i, s.status == SubmitStatus::queue_full ? "queue full" : "not ready");
  }
  {
    std::unique_lock<std::mutex> lk(run->mu);
    run->cv.wait(lk, [&] { return run->finished == prompts.size(); });
  }
  const double wall = run->since_start();
  for (const Result& r : run->results)
    if (!r.error.empty()) fail("engine error: {}", r.error);
  const EngineStats st = engine.stats();

  auto text_of = [&](const Result& r) { return r.text ? r.text->content() : std::string(); };
  if (prompts.size() == 1) {
    const Result& r = run->results[0];
    fmt::print("tokens: {}\n", fmt::join(r.tokens, ","));
    for (const std::string& l : r.logprob_lines) fmt::print("logprobs: {}\n", l);
    if (tk) {
      fmt::print("prompt tokens: {}\n", fmt::join(prompts[0].ids, ","));
      fmt::print("text: {}\n", text_of(r));
    }
    fmt::print("finish: {}\n", r.finish);
    fmt::print("prefill: {} tokens in {:.3f} s ({:.1f} tok/s)\n", prompts[0].ids.size(), r.first_token_s,
               double(prompts[0].ids.size()) / r.first_token_s);
    const int decoded = int(r.tokens.size()) - 1;
    if (decoded > 0)
      fmt::print("decode: {} tokens in {:.3f} s ({:.1f} tok/s)\n", decoded, r.done_s - r.first_token_s,
                 double(decoded) / (r.done_s - r.first_token_s));
  } else {
    int64_t in = 0, outn = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const Result& r = run->results[i];
      in += int64_t(prompts[i].ids.size());
      outn += int64_t(r.tokens.size());
      if (o.quiet) continue;
      fmt::print("[{}] tokens: {}\n", i, fmt::join(r.tokens, ","));
      for (const std::string& l : r.logprob_lines) fmt::print("[{}] logprobs: {}\n", i, l);
      if (tk) fmt::print("[{}] text: {}\n", i, text_of(r));
      fmt::print("[{}] finish: {}, {} prompt tokens, first token {:.3f} s, done {:.3f} s\n", i, r.finish,
                 prompts[i].ids.size(), r.first_token_s, r.done_s);
    }
    fmt::print("requests: {} in {:.3f} s; prompt {} tokens, generated {} tokens; {:.1f} generated tok/s, "
               "{:.1f} total tok/s\n",
               prompts.size(), wall, in, outn, double(outn) / wall, double(in + outn) / wall);
  }
  fmt::print("engine: {} steps, {} preemptions, prefix cache {} hits / {} queries skipping {} tokens, {} positions "
             "computed\n",
             st.steps, st.preemptions, st.prefix_hits, st.prefix_queries, st.prefix_hit_tokens, st.tokens_forwarded);
  if (st.ahead_steps > 0)  // --async-scheduling
    fmt::print("async scheduling: {} of {} steps launched ahead of the previous step's tokens\n", st.ahead_steps,
               st.steps);
  // DSpark (--speculative-config): vLLM's counters and the mean acceptance length (accepted draft tokens per
  // verification step, plus the token every step emits), what k3data/spec_eval.py reads.
  if (st.spec_drafts > 0)
    fmt::print("speculative: {} drafts, {} draft tokens, {} accepted; acceptance length {:.3f}\n", st.spec_drafts,
               st.spec_draft_tokens, st.spec_accepted_tokens,
               1.0 + double(st.spec_accepted_tokens) / double(st.spec_drafts));
  if (dump) {
    write_npy(o.dump_logits, run->dumped, int64_t(run->dumped.size()) / V, V);
    fmt::print("logits: {} positions written to {}\n", int64_t(run->dumped.size()) / V, o.dump_logits);
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOpts>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens through the serving engine (CPU or GPU)");
  o->engine.add_to(*cmd);
  auto* pt = cmd->add_option("--prompt-tokens", o->prompt_tokens, "comma-separated prompt token ids");
  auto* pr = cmd->add_option("--prompt", o->prompt, "prompt text, encoded with the checkpoint's tokenizer");
  auto* pf = cmd->add_option("--prompts-file", o->prompts_file, "one prompt per line (text, or ids:1,2,3), run at once");
  pt->excludes(pr)->excludes(pf);
  pr->excludes(pf);
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate per request")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o->temperature, "0 = greedy, at most 2");
  cmd->add_option("--top-p", o->top_p, "nucleus mass in (0, 1]");
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens (0 = off)");
  cmd->add_option("--min-p", o->min_p, "drop tokens below min_p x the top probability");
  cmd->add_option("--repetition-penalty", o->repetition_penalty, "over prompt + output tokens (1 = off)");
  cmd->add_option("--presence-penalty", o->presence_penalty, "subtracted once per output token id seen");
  cmd->add_option("--frequency-penalty", o->frequency_penalty, "subtracted per occurrence in the output");
  cmd->add_option("--seed", o->seed, "sampler seed (request i of a prompts file uses seed + i)");
  cmd->add_option("--stop", o->stop, "stop string (repeatable; needs the tokenizer)");
  cmd->add_option("--stop-token-id", o->stop_token_ids, "stop token id (repeatable)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "no token id ends a request (end-of-sequence ids and --stop-token-id)");
  cmd->add_option("--logprobs", o->logprobs, "print the sampled token's logprob and the N (<= 20) most likely");
  cmd->add_option("--dump-logits", o->dump_logits, "write f32 logits [positions, vocab] as .npy (single prompt)");
  cmd->add_flag("--quiet", o->quiet, "print only the summary for several prompts");
  cmd->add_option("--image", o->images,
                  "image file (PNG, JPEG, WebP; repeatable): with --prompt-tokens, the <|media_pad|> positions "
                  "receive the images in order")->check(CLI::ExistingFile);
  cmd->add_option("--max-image-pixels", o->max_image_pixels, "width x height of one --image (refused beyond)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
  cmd->callback([o] {
    o->engine.resolve_model();
    generate(*o);
  });
}

}  // namespace kestrel::cli

// `shadowkv eval`: RULER-style long-context tasks, the NIAH depth grid and multi-turn NIAH under
// several KV policies at once (one shared prefill per sample), with tables, JSON, CSV and plots;
// answered on the CPU, or with --device cuda by full attention and ShadowKV on the GPU.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "commands.h"
#include "cuda_environment.h"
#include "eval_cuda_backend.h"
#include "eval/haystack.h"
#include "eval/report.h"
#include "eval/runner.h"
#include "format/chat_template.h"
#include "kv/policies.h"
#include "model/cpu_model.h"
#include "options.h"


namespace shadowkv::app {
namespace {

using Clock = std::chrono::steady_clock;

struct EvalOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  std::string tasks = "all";
  std::string lengths = "4k";
  int samples = 4;
  uint64_t seed = 42;
  double depth = -1.0;
  std::string haystack;
  bool niah_grid = false;
  int grid_depths = 10;
  int multi_turn = 0;
  bool fresh_turns = false;
  std::string held_turns;  // --held-turns (GPU ShadowKV conversations; empty: exact)
  bool fidelity = false;
  int prefill_chunk = 512;
  Device device = Device::kCpu;  // with cuda, full and shadowkv are answered on the GPU
  bool plain = false;
  bool quiet = false;
  std::string json_path;
  std::string csv_path;
  std::string png_path;
};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// "4k" = 4096, "1.5k" = 1536, "128K", "1m", or a plain token count.
Result<int64_t> ParseLength(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix = end ? std::string(end) : "";
  if (suffix == "k" || suffix == "K") {
    scale = 1024;
  } else if (suffix == "m" || suffix == "M") {
    scale = 1024 * 1024;
  } else if (!suffix.empty()) {
    return Error(ErrorCode::kInvalidArgument, "cannot read context length '{}'", text);
  }
  const auto tokens = static_cast<int64_t>(std::llround(value * scale));
  if (end == text.c_str() || tokens < 64) {
    return Error(ErrorCode::kInvalidArgument, "context length '{}' is not a length of at least 64",
                 text);
  }
  return tokens;
}

std::string FormatDuration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// sha256 of the model file through sha256sum, or "" where that is not available.
std::string FileSha256(const std::string& path) {
  std::string quoted = "'";
  for (char c : path) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  FILE* pipe = popen(("sha256sum -- " + quoted + " 2>/dev/null").c_str(), "r");
  if (!pipe) return "";
  char buffer[128] = {};
  const size_t got = std::fread(buffer, 1, 64, pipe);
  pclose(pipe);
  return got == 64 ? std::string(buffer, 64) : "";
}

// The report of a run still going to `json_path`, through a temporary file renamed over it so a
// reader never sees half a file. A failure only costs the partial copy: it is not reported.
void WritePartialReport(const eval::EvalReport& partial, const std::string& model_path,
                        const std::string& json_path) {
  eval::EvalReport report = partial;
  report.model_path = model_path;
  const std::string temporary = json_path + ".partial";
  {
    std::ofstream out(temporary);
    out << eval::ReportToJson(report).dump(1) << "\n";
    if (!out) return;
  }
  std::rename(temporary.c_str(), json_path.c_str());
}

bool NeedsCorpus(const eval::EvalSettings& settings) {
  if (settings.mode == eval::EvalMode::kMultiTurn) return true;
  for (const std::string& task : settings.tasks) {
    if (task != "niah_single_1" && task != "niah_multikey_2" && task != "niah_multikey_3" &&
        task != "vt" && task != "fwe" && task != "passkey") {
      return true;
    }
  }
  return false;
}


int RunEvalCommand(const EvalOptions& o) {
  eval::EvalSettings settings;
  settings.mode = o.niah_grid    ? eval::EvalMode::kNiahGrid
                  : o.multi_turn ? eval::EvalMode::kMultiTurn
                                 : eval::EvalMode::kTasks;
  if (o.niah_grid && o.multi_turn) return Fail("--niah-grid and --multi-turn are separate modes");
  if (!o.held_turns.empty() && o.device != Device::kCuda) {
    return Fail("--held-turns chooses the GPU's way (--device cuda); the CPU's policies take "
                "follow-ups in their own sequences");
  }
  if (o.tasks == "all") {
    if (settings.mode == eval::EvalMode::kNiahGrid) {
      settings.tasks = {"niah_single_2"};
    } else {
      for (const auto& task : eval::AllTasks()) settings.tasks.push_back(task.name);
    }
  } else {
    settings.tasks = SplitList(o.tasks);
    for (const std::string& task : settings.tasks) {
      if (!eval::FindTask(task)) {
        return Fail(fmt::format("unknown task '{}' ({})", task, eval::kUnavailableTasksNote));
      }
    }
  }
  for (const std::string& text : SplitList(o.lengths)) {
    auto length = ParseLength(text);
    if (!length.ok()) return Fail(length.status().ToString());
    settings.lengths.push_back(*length);
  }
  settings.samples = o.samples;
  settings.seed = o.seed;
  settings.depth = o.depth;
  settings.turns = o.multi_turn;
  settings.fresh_turns = o.fresh_turns;
  settings.fidelity = o.fidelity;
  settings.prefill_chunk = o.prefill_chunk;
  for (int i = 0; i < o.grid_depths; ++i) {
    settings.grid_depths.push_back(
        o.grid_depths == 1 ? 50.0 : std::round(1000.0 * i / (o.grid_depths - 1)) / 10.0);
  }
  for (const std::string& name : SplitList(o.kv.policy)) {
    auto config = kv::ParseKvVariant(name, o.kv);
    if (!config.ok()) return Fail(config.status().ToString());
    settings.policies.push_back(*config);
  }

  const std::string model_path = ResolveModelPath(o.model);
  auto model_or = LoadModel(o.model);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  CpuModel& model = **model_or;
  eval::PromptFormat format = eval::PromptFormat::Plain();
  if (!o.plain) {
    auto chat_template = DetectChatTemplate(model.file());
    if (!chat_template.ok()) {
      return Fail(chat_template.status().ToString() + " (use --plain for no chat template)");
    }
    format = eval::PromptFormat::Chat(*chat_template);
  }
  eval::EssayCorpus corpus;
  std::vector<std::string> vocabulary;
  if (NeedsCorpus(settings) || !o.haystack.empty()) {
    auto loaded = eval::LoadEssayCorpus(o.haystack);
    if (!loaded.ok()) return Fail(loaded.status().ToString());
    corpus = std::move(loaded).value();
    vocabulary = eval::CorpusVocabulary(corpus);
  }
  const eval::TaskContext tasks =
      eval::MakeTaskContext(model, format, corpus.words.empty() ? nullptr : &corpus, &vocabulary);

  std::unique_ptr<eval::AnswerBackend> backend;
  if (o.device == Device::kCuda) {
    int64_t longest = 0;
    for (int64_t length : settings.lengths) longest = std::max(longest, length);
    auto made =
        MakeCudaEvalBackend(model_path, model, std::min(longest, model.config().context_length),
                            o.prefill_chunk, settings.fidelity, o.held_turns != "decode",
                            o.held_turns.empty() || o.held_turns == "exact");
    if (!made.ok()) return Fail(made.status().ToString());
    backend = std::move(made).value();
    // Before the header line: a policy the backend cannot run fails here, and the numerics it
    // reports depend on the policies.
    if (Status checked = backend->Check(settings.policies, settings.fidelity,
                                       settings.mode == eval::EvalMode::kMultiTurn);
        !checked.ok()) {
      return Fail(checked.ToString());
    }
  }

  std::fprintf(stderr, "eval: %s; model %s (%s; %s numerics); prompts: %s; policies:",
               eval::EvalModeName(settings.mode), model_path.c_str(),
               model.config().Summary().c_str(),
               backend ? backend->numerics().c_str() : NumericsName(model.numerics()),
               format.name().c_str());
  for (const auto& config : settings.policies) {
    std::fprintf(stderr, " %s", config.display_name().c_str());
    if (kv::IsPolicy(config, kv::PolicyKind::kFull)) continue;
    std::string budgets;
    for (int64_t length : settings.lengths) {
      budgets += fmt::format("{}{}", budgets.empty() ? "" : "/", config.BudgetTokens(length));
    }
    std::fprintf(stderr, "(budget %s)", budgets.c_str());
  }
  std::fprintf(stderr, "\n");

  std::string json_path = o.json_path;
  if (json_path.empty() && !o.png_path.empty()) json_path = "eval.json";
  const bool terminal = isatty(STDERR_FILENO) && !o.quiet;
  const auto start = Clock::now();
  auto last_line = start, last_partial = start;
  auto progress = [&](const eval::EvalProgress& p) {
    // Every 30 s the questions answered so far go to the JSON file ("complete": false), so a run
    // stopped before its end leaves what it did; the finished report replaces it.
    if (!json_path.empty() && p.partial && p.done > 0 && !p.current.empty() &&
        std::chrono::duration<double>(Clock::now() - last_partial).count() >= 30.0) {
      WritePartialReport(*p.partial, model_path, json_path);
      last_partial = Clock::now();
    }
    if (o.quiet) return;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    std::string eta = "?";
    if (p.done_weight > 0) {
      eta = FormatDuration(elapsed / p.done_weight * (p.total_weight - p.done_weight));
    }
    const std::string line =
        fmt::format("[eval] {}/{} done | {} elapsed, ETA {} | {}", p.done, p.total,
                    FormatDuration(elapsed), eta, p.current.empty() ? "finished" : p.current);
    if (terminal) {
      std::fprintf(stderr, "\r%s\033[K", line.c_str());
      if (p.current.empty()) std::fprintf(stderr, "\n");
    } else if (p.current.empty() || p.done == 0 ||
               std::chrono::duration<double>(Clock::now() - last_line).count() >= 30.0) {
      std::fprintf(stderr, "%s\n", line.c_str());
      last_line = Clock::now();
    }
  };
  auto report_or = eval::RunEval(model, format, tasks, settings, progress, backend.get());
  if (terminal) std::fprintf(stderr, "\n");
  if (!report_or.ok()) return Fail(report_or.status().ToString());
  eval::EvalReport& report = *report_or;
  report.model_path = model_path;
  report.model_sha256 = FileSha256(model_path);

  std::fputs(eval::FormatTables(report).c_str(), stdout);
  std::printf("%zu questions in %s\n", report.questions.size(),
              FormatDuration(report.seconds).c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << eval::ReportToJson(report).dump(1) << "\n";
    if (!out) return Fail(fmt::format("cannot write '{}'", json_path));
    std::printf("JSON written to %s\n", json_path.c_str());
  }
  if (!o.csv_path.empty()) {
    std::ofstream out(o.csv_path);
    out << eval::ReportToCsv(report);
    if (!out) return Fail(fmt::format("cannot write '{}'", o.csv_path));
    std::printf("CSV written to %s\n", o.csv_path.c_str());
  }
  if (!o.png_path.empty()) {
    std::fflush(stdout);
    const std::string command = fmt::format("python3 '{}/scripts/plot_eval.py' '{}' '{}'",
                                            SHADOWKV_SOURCE_DIR, json_path, o.png_path);
    if (std::system(command.c_str()) != 0)
      return Fail("plotting failed (needs python3-matplotlib)");
  }
  return 0;
}

}  // namespace

Command AddEvalCommand(CLI::App& app) {
  auto options = std::make_shared<EvalOptions>();
  options->kv.policy = "full,shadowkv,snapkv,quest,streaming";
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Long-context accuracy (RULER-style tasks, NIAH grid, multi-turn NIAH) per KV policy");
  AddModelOptions(*cmd, options->model);
  AddKvOptions(*cmd, options->kv);
  cmd->get_option("--kv")->description(
      "KV policies to compare, comma-separated: full, shadowkv, snapkv, quest, streaming; a "
      "variant takes its own settings, e.g. shadowkv:rank=64:budget=512");
  cmd->add_option("--tasks", options->tasks,
                  "comma-separated tasks or 'all': niah_single_1..3, niah_multikey_1..3, "
                  "niah_multivalue, niah_multiquery, vt, cwe, fwe, passkey")
      ->capture_default_str();
  cmd->add_option("--lengths", options->lengths,
                  "context lengths (prompt + answer), e.g. 2k,4k,8192")
      ->capture_default_str();
  cmd->add_option("--samples", options->samples, "samples per task and length (per grid cell)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", options->seed, "seed of the task synthesis")->capture_default_str();
  cmd->add_option("--depth", options->depth,
                  "needle depth in percent of the haystack (default: random per sample)")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--haystack", options->haystack,
                  "essay haystack text file (.gz allowed; default: the Jargon File of Debian's "
                  "jargon-text)");
  auto* grid = cmd->add_flag("--niah-grid", options->niah_grid,
                             "NIAH grid: context lengths x needle depths (task: niah_single_2, "
                             "or the one given with --tasks)");
  cmd->add_option("--grid-depths", options->grid_depths, "needle depths of the grid, 0..100%")
      ->capture_default_str()
      ->check(CLI::Range(1, 101));
  auto* turns =
      cmd->add_option("--multi-turn", options->multi_turn,
                      "multi-turn NIAH: N needles, asked one per turn in one conversation")
          ->check(CLI::Range(1, 40))
          ->excludes(grid);
  cmd->add_flag("--fresh-turns", options->fresh_turns,
                "multi-turn: prefill each policy's whole conversation again for every turn "
                "instead of reusing its KV (the reference for reuse)")
      ->needs(turns);
  cmd->add_option("--held-turns", options->held_turns,
                  "multi-turn with --device cuda: how a held ShadowKV conversation takes a later "
                  "turn's follow-up, as `serve --held-turns` does: exact (the default: the "
                  "sequence decompressed into a full-cache slot from a copy of the prompt's "
                  "exact keys kept at compression, the follow-up prefilled there with full "
                  "attention, the whole compressed again), recompress (the same from the rank-r "
                  "keys) or decode (one decode step per token)")
      ->check(CLI::IsMember({"decode", "recompress", "exact"}))
      ->needs(turns);
  cmd->add_flag("--fidelity", options->fidelity,
                "tasks and grid: after the answers every policy also follows the first "
                "policy's answer token by token; the table footer gives how often its top token "
                "is the first policy's and the mean KL divergence from it (with --device cuda: "
                "full first, GPU policies only)")
      ->excludes(turns);
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prompt tokens per forward step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  AddDeviceOption(
      *cmd, options->device,
      "cpu | cuda: with cuda, full attention and ShadowKV answer on the GPU (bf16), the "
      "other policies (and ShadowKV where its kernels do not take the model's heads) decode on "
      "the CPU from the GPU's prefill; --multi-turn holds full attention's and ShadowKV's "
      "conversations on the GPU, one policy after another");
  cmd->add_flag("--plain", options->plain, "no chat template: the task text as is");
  cmd->add_flag("-q,--quiet", options->quiet, "no progress lines");
  cmd->add_option("--json", options->json_path,
                  "write the full report as JSON (while the run goes on, every 30 s the questions "
                  "answered so far, with \"complete\": false)");
  cmd->add_option("--csv", options->csv_path, "write the scores as CSV");
  cmd->add_option("--png", options->png_path,
                  "plot (scripts/plot_eval.py): heatmaps for --niah-grid, per-turn accuracy for "
                  "--multi-turn, bars otherwise");
  return [options] { return RunEvalCommand(*options); };
}

}  // namespace shadowkv::app

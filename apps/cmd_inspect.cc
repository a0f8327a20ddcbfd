// `shadowkv inspect`: the paper's observations on a real model and prompt — singular-value
// spectra of pre-RoPE keys, post-RoPE keys and values per layer, chunk landmark fidelity
// (min cosine similarity, outlier fraction), and ShadowKV's chunk hit rate over a decode run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "engine/sampler.h"
#include "kv/low_rank.h"
#include "kv/shadowkv_policy.h"
#include "model/cpu_model.h"
#include "options.h"

namespace shadowkv::app {
namespace {

struct InspectOptions {
  ModelOptions model;
  kv::KvPolicyConfig kv;
  std::string prompt;
  std::string prompt_file;
  int decode_tokens = 64;
  int max_spectrum = 64;  // singular values kept per series in the JSON
  std::string json_path = "inspect.json";
  std::string png_path;
};

// Full attention that also keeps each layer's pre-RoPE keys, post-RoPE keys and values.
class RecordingSequence final : public kv::ForwardingSequenceKv {
 public:
  RecordingSequence(std::unique_ptr<kv::SequenceKv> inner, int layers, int width)
      : ForwardingSequenceKv(std::move(inner)),
        k_pre(layers),
        k_post(layers),
        values(layers),
        width_(width) {}
  Status Append(int layer, const kv::TokenBlock& block) override {
    SKV_RETURN_IF_ERROR(inner_->Append(layer, block));
    const size_t n = static_cast<size_t>(block.num_tokens) * width_;
    k_pre[layer].insert(k_pre[layer].end(), block.keys_pre_rope, block.keys_pre_rope + n);
    k_post[layer].insert(k_post[layer].end(), block.keys, block.keys + n);
    values[layer].insert(values[layer].end(), block.values, block.values + n);
    return Status::Ok();
  }

  std::vector<std::vector<float>> k_pre, k_post, values;  // [layer][token * kv_width]

 private:
  int width_;
};

// Spectrum summary of rows [tokens, width]: leading singular values, the ranks holding each
// energy level, and (`rule`) the rank ShadowKV's rank_energy rule picks at each level (multiple
// of 8, the settings' floor and cap; one basis over the whole width).
Result<nlohmann::json> Spectrum(const std::vector<float>& rows, int64_t tokens, int width, int keep,
                                const kv::KvPolicyConfig& rule, int head_dim) {
  const std::vector<double> gram = kv::GramMatrix(rows.data(), tokens, width, width);
  SKV_ASSIGN_OR_RETURN(std::vector<double> eig, kv::GramEigenvalues(gram, width));
  double total = 0;
  for (double e : eig) total += std::max(0.0, e);
  nlohmann::json ranks, chosen;
  for (double level : {0.90, 0.95, 0.99}) {
    double cumulative = 0;
    int rank = 0;
    while (rank < width && cumulative < level * total) cumulative += std::max(0.0, eig[rank++]);
    const std::string key = fmt::format("{:.0f}", level * 100);
    ranks[key] = rank;
    chosen[key] = kv::RankForEnergy(eig, total, level, kv::RankFloor(rule, head_dim),
                                    std::min(rule.rank_max, width));
  }
  std::vector<double> singular;
  const double top = std::sqrt(std::max(eig.empty() ? 0.0 : eig[0], 1e-30));
  for (int i = 0; i < std::min(keep, width); ++i) {
    singular.push_back(std::sqrt(std::max(0.0, eig[i])) / top);  // relative to the largest
  }
  return nlohmann::json{{"rank_for_energy", ranks},
                        {"shadowkv_rank_for_energy", chosen},
                        {"relative_singular_values", singular}};
}

// Per chunk and KV head, the smallest cosine similarity between the chunk's landmark (mean
// post-RoPE key) and its keys.
std::vector<double> ChunkMinCosines(const std::vector<float>& keys, int64_t tokens, int heads,
                                    int head_dim, int chunk) {
  std::vector<double> result;
  const int width = heads * head_dim;
  for (int64_t c = 0; c + chunk <= tokens; c += chunk) {
    for (int h = 0; h < heads; ++h) {
      std::vector<double> mean(head_dim, 0.0);
      for (int t = 0; t < chunk; ++t)
        for (int i = 0; i < head_dim; ++i) mean[i] += keys[(c + t) * width + h * head_dim + i];
      double mean_norm = 0;
      for (double& m : mean) {
        m /= chunk;
        mean_norm += m * m;
      }
      double min_cos = 1.0;
      for (int t = 0; t < chunk; ++t) {
        double dot = 0, norm = 0;
        for (int i = 0; i < head_dim; ++i) {
          const double k = keys[(c + t) * width + h * head_dim + i];
          dot += k * mean[i];
          norm += k * k;
        }
        min_cos = std::min(min_cos, dot / std::sqrt(std::max(norm * mean_norm, 1e-30)));
      }
      result.push_back(min_cos);
    }
  }
  return result;
}

// Runs `prompt` through `kv` in chunks; the last token's logits go to `last_logits`.
Status Prefill(CpuModel& model, kv::SequenceKv* kv, const std::vector<int32_t>& prompt,
               float* last_logits) {
  const auto tokens = static_cast<int64_t>(prompt.size());
  for (int64_t done = 0; done < tokens; done += 512) {
    const int64_t count = std::min<int64_t>(512, tokens - done);
    StepInput in;
    in.kv = kv;
    in.tokens = std::span<const int32_t>(prompt.data() + done, count);
    in.finish_prefill = done + count == tokens;
    in.logits = in.finish_prefill ? StepInput::Logits::kLast : StepInput::Logits::kNone;
    in.logits_out = last_logits;
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
  }
  return Status::Ok();
}

struct DecodeRun {
  std::vector<int32_t> tokens;  // the tokens fed in order, starting with the first
  int64_t forced_matches = 0;   // teacher-forced: steps whose argmax was the forced next token
  kv::PolicyStats stats;
  std::vector<kv::PolicyStats> layer_stats;
  std::vector<int> layer_ranks;     // ShadowKV: each layer's key rank at the end
  double fast_bytes_per_token = 0;  // the sequence's fast tier over the tokens it holds
};

// `steps` greedy decode steps from `first_token`. With `forced`, token i + 1 fed is forced[i + 1]
// whatever the model prefers, and agreement with it is counted.
Result<DecodeRun> GreedyDecode(CpuModel& model, kv::SequenceKv* kv, int32_t first_token, int steps,
                               const std::vector<int32_t>* forced) {
  DecodeRun run;
  std::vector<float> logits(model.config().vocab_size);
  int32_t next = first_token;
  for (int step = 0; step < steps; ++step) {
    run.tokens.push_back(next);
    StepInput in;
    in.kv = kv;
    in.tokens = std::span<const int32_t>(&run.tokens.back(), 1);
    in.logits_out = logits.data();
    SKV_RETURN_IF_ERROR(model.Forward(std::span<const StepInput>(&in, 1)));
    next = Argmax(std::span<const float>(logits));
    if (forced && step + 1 < steps) {
      run.forced_matches += next == (*forced)[step + 1];
      next = (*forced)[step + 1];
    }
  }
  run.stats = kv->stats();
  run.layer_stats = kv->layer_stats();
  return run;
}

// A fresh sequence of `policy` prefilled with `prompt`, then GreedyDecode. When forced, the
// first token too is the reference's (counted like the others).
Result<DecodeRun> ShadowDecode(CpuModel& model, const kv::KvPolicy& policy,
                               const std::vector<int32_t>& prompt, int steps,
                               const std::vector<int32_t>* forced) {
  SKV_ASSIGN_OR_RETURN(auto sequence, policy.NewSequence());
  std::vector<float> logits(model.config().vocab_size);
  SKV_RETURN_IF_ERROR(Prefill(model, sequence.get(), prompt, logits.data()));
  int32_t first = Argmax(std::span<const float>(logits));
  int64_t first_match = 0;
  if (forced && steps > 0) {
    first_match = first == (*forced)[0];
    first = (*forced)[0];
  }
  SKV_ASSIGN_OR_RETURN(DecodeRun run, GreedyDecode(model, sequence.get(), first, steps, forced));
  // The first forced token's agreement replaces the last step's (which has nothing to match).
  run.forced_matches += first_match;
  if (const auto* shadow = dynamic_cast<const kv::ShadowKvSequence*>(sequence.get())) {
    for (int l = 0; l < model.config().num_layers; ++l) {
      run.layer_ranks.push_back(shadow->Inspect(l).rank);
    }
  }
  if (sequence->num_tokens() > 0) {
    run.fast_bytes_per_token =
        static_cast<double>(sequence->memory().fast_bytes) / sequence->num_tokens();
  }
  return run;
}

int RunInspect(const InspectOptions& o) {
  auto prompt_text = ReadPromptText(o.prompt, o.prompt_file);
  if (!prompt_text.ok()) return Fail(prompt_text.status().message());
  const std::string& text = *prompt_text;
  auto model_or = LoadModel(o.model);
  if (!model_or.ok()) return Fail(model_or.status().ToString());
  CpuModel& model = **model_or;
  const auto& c = model.config();
  const int width = c.num_kv_heads * c.head_dim;
  std::vector<int32_t> prompt = model.tokenizer().Encode(text, true, false);
  if (static_cast<int64_t>(prompt.size()) + o.decode_tokens > c.context_length) {
    return Fail(fmt::format("prompt of {} tokens plus {} decode tokens exceeds the context of {}",
                            prompt.size(), o.decode_tokens, c.context_length));
  }
  const int64_t tokens = static_cast<int64_t>(prompt.size());

  // 1. Record K/V over the prompt with full attention.
  kv::KvPolicyConfig full_config;
  auto full = kv::MakeKvPolicy(full_config, model.kv_geometry());
  if (!full.ok()) return Fail(full.status().ToString());
  RecordingSequence recording((*full)->NewSequence().value(), c.num_layers, width);
  std::vector<float> prefill_logits(c.vocab_size);
  if (Status s = Prefill(model, &recording, prompt, prefill_logits.data()); !s.ok()) {
    return Fail(s.ToString());
  }
  nlohmann::json layers = nlohmann::json::array();
  const int chunk = o.kv.chunk_size;
  for (int l = 0; l < c.num_layers; ++l) {
    nlohmann::json layer = {{"layer", l}};
    for (auto [name, rows] : {std::pair{"pre_rope_keys", &recording.k_pre[l]},
                              std::pair{"post_rope_keys", &recording.k_post[l]},
                              std::pair{"values", &recording.values[l]}}) {
      auto spectrum = Spectrum(*rows, tokens, width, o.max_spectrum, o.kv, c.head_dim);
      if (!spectrum.ok()) return Fail(spectrum.status().ToString());
      layer[name] = *spectrum;
    }
    std::vector<double> cosines =
        ChunkMinCosines(recording.k_post[l], tokens, c.num_kv_heads, c.head_dim, chunk);
    std::sort(cosines.begin(), cosines.end());
    auto fraction_below = [&](double x) {
      return cosines.empty()
                 ? 0.0
                 : static_cast<double>(std::lower_bound(cosines.begin(), cosines.end(), x) -
                                       cosines.begin()) /
                       cosines.size();
    };
    layer["chunk_min_cosine"] = {{"chunks", cosines.size()},
                                 {"median", cosines.empty() ? 0.0 : cosines[cosines.size() / 2]},
                                 {"fraction_below_0.5", fraction_below(0.5)},
                                 {"fraction_below_0.8", fraction_below(0.8)}};
    layers.push_back(layer);
  }

  // 2. Greedy decode: full attention gives the reference tokens; ShadowKV runs free (its hit
  // rate, its own tokens) and teacher-forced on the reference (top-1 agreement step by step,
  // with no drift from an earlier divergence).
  const int32_t first_token = Argmax(std::span<const float>(prefill_logits));
  auto reference = GreedyDecode(model, &recording, first_token, o.decode_tokens, nullptr);
  if (!reference.ok()) return Fail(reference.status().ToString());
  kv::KvPolicyConfig skv_config = o.kv;
  skv_config.policy = "shadowkv";
  auto shadow = kv::MakeKvPolicy(skv_config, model.kv_geometry());
  if (!shadow.ok()) return Fail(shadow.status().ToString());
  auto free_run = ShadowDecode(model, **shadow, prompt, o.decode_tokens, nullptr);
  if (!free_run.ok()) return Fail(free_run.status().ToString());
  auto forced = ShadowDecode(model, **shadow, prompt, o.decode_tokens, &reference->tokens);
  if (!forced.ok()) return Fail(forced.status().ToString());
  const kv::PolicyStats& stats = free_run->stats;
  std::vector<double> layer_hits;
  for (const kv::PolicyStats& s : free_run->layer_stats) layer_hits.push_back(s.hit_rate());
  int64_t same_position = 0;
  int64_t first_divergence = -1;
  for (int i = 0; i < o.decode_tokens; ++i) {
    if (free_run->tokens[i] == reference->tokens[i]) {
      ++same_position;
    } else if (first_divergence < 0) {
      first_divergence = i;
    }
  }
  const double steps = std::max(1, o.decode_tokens);
  const double free_agreement = same_position / steps;
  const double forced_agreement = forced->forced_matches / steps;

  nlohmann::json report = {
      {"model", c.Summary()},
      {"prompt_tokens", tokens},
      {"chunk_size", chunk},
      {"layers", layers},
      {"shadowkv",
       {{"decode_tokens", o.decode_tokens},
        {"hit_rate", stats.hit_rate()},
        {"hit_rate_per_layer", layer_hits},
        {"rank_per_layer", free_run->layer_ranks},
        {"fast_bytes_per_token", free_run->fast_bytes_per_token},
        {"agreement_with_full",
         {{"free_running", free_agreement},
          {"first_divergence", first_divergence},
          {"teacher_forced_top1", forced_agreement},
          {"full_tokens", reference->tokens},
          {"shadowkv_tokens", free_run->tokens}}},
        {"attended_fraction",
         stats.context_tokens ? static_cast<double>(stats.attended_tokens) / stats.context_tokens
                              : 0.0}}}};
  std::ofstream(o.json_path) << report.dump(1) << "\n";
  // Summary on stdout: per layer the ranks for 90% energy, the rank_energy rule's picks for
  // pre-RoPE keys at 90/95/99%, and the rank this run's ShadowKV used.
  std::printf("%5s %10s %10s %10s %17s %5s %12s %10s\n", "layer", "preK r90", "postK r90", "V r90",
              "rule r90/95/99", "rank", "minCos<0.5", "hit rate");
  for (int l = 0; l < c.num_layers; ++l) {
    const auto& L = layers[l];
    const auto& rule = L["pre_rope_keys"]["shadowkv_rank_for_energy"];
    const std::string picks = fmt::format("{}/{}/{}", rule["90"].get<int>(), rule["95"].get<int>(),
                                          rule["99"].get<int>());
    std::printf("%5d %10d %10d %10d %17s %5d %11.1f%% %9.1f%%\n", l,
                L["pre_rope_keys"]["rank_for_energy"]["90"].get<int>(),
                L["post_rope_keys"]["rank_for_energy"]["90"].get<int>(),
                L["values"]["rank_for_energy"]["90"].get<int>(), picks.c_str(),
                l < static_cast<int>(free_run->layer_ranks.size()) ? free_run->layer_ranks[l] : 0,
                100 * L["chunk_min_cosine"]["fraction_below_0.5"].get<double>(),
                l < static_cast<int>(layer_hits.size()) ? 100 * layer_hits[l] : 0.0);
  }
  std::printf(
      "ShadowKV hit rate over %d decode steps: %.1f%%; fast-tier KV %.0f bytes per token; JSON "
      "written to %s\n",
      o.decode_tokens, 100 * stats.hit_rate(), free_run->fast_bytes_per_token, o.json_path.c_str());
  std::printf(
      "Greedy tokens vs full attention over %d steps: %.1f%% identical free-running (first "
      "divergence at step %lld), %.1f%% top-1 agreement teacher-forced\n",
      o.decode_tokens, 100 * free_agreement, static_cast<long long>(first_divergence),
      100 * forced_agreement);
  if (!o.png_path.empty()) {
    const std::string command = fmt::format("python3 '{}/scripts/plot_inspect.py' '{}' '{}'",
                                            SHADOWKV_SOURCE_DIR, o.json_path, o.png_path);
    if (std::system(command.c_str()) != 0)
      return Fail("plotting failed (needs python3-matplotlib)");
  }
  return 0;
}

}  // namespace

Command AddInspectCommand(CLI::App& app) {
  auto options = std::make_shared<InspectOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Spectra of K/V, landmark fidelity and ShadowKV hit rate on a prompt");
  AddModelOptions(*cmd, options->model);
  AddKvOptions(*cmd, options->kv);
  auto* prompt = cmd->add_option("-p,--prompt", options->prompt, "prompt text");
  cmd->add_option("-f,--file", options->prompt_file, "read the prompt from a file")
      ->excludes(prompt);
  cmd->add_option("--decode", options->decode_tokens, "greedy decode steps for the hit rate")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", options->json_path, "JSON report path")->capture_default_str();
  cmd->add_option("--png", options->png_path, "also plot the spectra to this PNG");
  return [options] { return RunInspect(*options); };
}

}  // namespace shadowkv::app

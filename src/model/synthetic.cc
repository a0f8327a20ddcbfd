// Synthetic model shapes, from the models' published configurations.
#include "model/synthetic.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "format/gguf_writer.h"
#include "format/tokenizer.h"

namespace shadowkv {
namespace {

struct NamedShape {
  const char* name;
  const char* display;
  int num_layers, hidden_size, num_query_heads, num_kv_heads, head_dim, ffn_size;
  int64_t vocab_size, context_length;
  float rope_theta;
  bool tied_embeddings;
};

// Llama-3-8B: shapes as in DESIGN.md (Llama-3.1-8B differs only in context and RoPE scaling).
// Llama-3-70B: its published shapes (141 GB of bf16 weights: one H200 holds it only split).
// SmolLM2-135M: as its GGUF metadata gives it (the project's default small model).
// Qwen2.5-0.5B: as Qwen2.5-Coder-0.5B-Instruct's GGUF gives it (the project's long-context model;
// narrow keys: 2 KV heads of 64), without its Q/K/V biases and in the llama layout.
constexpr NamedShape kShapes[] = {
    {"llama3-8b", "Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0f, false},
    {"llama3-70b", "Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 131072, 500000.0f, false},
    {"smollm2-135m", "SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0f, true},
    {"qwen2.5-0.5b", "Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, 32768, 1000000.0f, true},
};

}  // namespace

std::vector<std::string> SyntheticModelNames() {
  std::vector<std::string> names;
  for (const NamedShape& s : kShapes) names.emplace_back(s.name);
  return names;
}

Result<ModelConfig> SyntheticModelConfig(std::string_view name) {
  for (const NamedShape& s : kShapes) {
    if (name != s.name) continue;
    ModelConfig c;
    c.architecture = "llama";
    c.name = fmt::format("{} (synthetic random weights)", s.display);
    c.num_layers = s.num_layers;
    c.hidden_size = s.hidden_size;
    c.num_query_heads = s.num_query_heads;
    c.num_kv_heads = s.num_kv_heads;
    c.head_dim = s.head_dim;
    c.ffn_size = s.ffn_size;
    c.vocab_size = s.vocab_size;
    c.context_length = s.context_length;
    c.rms_norm_eps = 1e-5f;
    c.qkv_bias = false;
    c.tied_embeddings = s.tied_embeddings;
    c.rope.rotary_dim = s.head_dim;
    c.rope.theta_base = s.rope_theta;
    c.rope.style = RopeConfig::Style::kPairs;
    return c;
  }
  return Error(ErrorCode::kNotFound, "no synthetic model '{}' (known: {})", name,
               fmt::join(SyntheticModelNames(), ", "));
}

Result<std::unique_ptr<gguf::GgufFile>> SyntheticVocabularyFile(int64_t vocab_size) {
  constexpr int64_t kBytes = 256;
  const std::string_view specials[] = {"<|im_start|>", "<|im_end|>", kSyntheticEndOfText};
  constexpr int64_t kSpecials = std::size(specials);
  if (vocab_size < kBytes + kSpecials || vocab_size > kMaxVocab) {
    return Error(ErrorCode::kInvalidArgument,
                 "a synthetic vocabulary of {} tokens: it needs {} to {} (the bytes and {} "
                 "special tokens at least)",
                 vocab_size, kBytes + kSpecials, kMaxVocab, kSpecials);
  }
  std::vector<std::string> tokens;
  tokens.reserve(static_cast<size_t>(vocab_size));
  for (int byte = 0; byte < kBytes; ++byte) {
    const char raw = static_cast<char>(byte);
    tokens.push_back(ByteLevelText(std::string_view(&raw, 1)));
  }
  // Fillers decode to distinct words, so a synthetic model's output is visibly made of them.
  for (int64_t id = kBytes; id < vocab_size - kSpecials; ++id) {
    tokens.push_back(ByteLevelText(fmt::format(" t{}", id)));
  }
  std::vector<int32_t> types(tokens.size(), static_cast<int32_t>(TokenType::kNormal));
  for (std::string_view special : specials) {
    tokens.emplace_back(special);
    types.push_back(static_cast<int32_t>(TokenType::kControl));
  }
  gguf::GgufWriter writer;
  writer.AddString("general.architecture", "llama");
  writer.AddString("general.name", "synthetic vocabulary");
  writer.AddString("tokenizer.ggml.model", "gpt2");
  writer.AddString("tokenizer.ggml.pre", "default");
  writer.AddStringArray("tokenizer.ggml.tokens", tokens);
  writer.AddInt32Array("tokenizer.ggml.token_type", types);
  writer.AddStringArray("tokenizer.ggml.merges", {});
  writer.AddUint32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(vocab_size - 1));
  writer.AddBool("tokenizer.ggml.add_bos_token", false);
  writer.AddString("tokenizer.chat_template",
                   "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                   "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
  const std::vector<uint8_t> image = writer.Finish();
  return gguf::GgufFile::FromBytes(image);
}

}  // namespace shadowkv

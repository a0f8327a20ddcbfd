// Shapes of well-known models for synthetic-weight runs: random weights, real sizes. Decode
// throughput does not depend on weight values, but every output made this way must say so.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "format/gguf.h"
#include "model/config.h"

namespace shadowkv {

// The label every synthetic-weight result carries.
inline constexpr std::string_view kSyntheticLabel =
    "SYNTHETIC WEIGHTS (random values, real shapes): throughput only, outputs are meaningless";

// Names SyntheticModelConfig knows, e.g. "llama3-8b".
std::vector<std::string> SyntheticModelNames();

// The config of a named model (architecture, sizes, RoPE); kNotFound lists the known names.
Result<ModelConfig> SyntheticModelConfig(std::string_view name);

// The vocabulary a synthetic model is served with (the server needs a tokenizer and a GGUF file
// for its chat template): `vocab_size` tokens, ids 0..255 the 256 bytes, then filler tokens
// (" t<id>"), then the ChatML turn tokens and an end-of-text token (EOS) as the last three ids.
// No merges, so text encodes to byte tokens only; a token-id prompt may name any id. Built in
// memory as a GGUF holding only tokenizer metadata. kInvalidArgument below 259 tokens or above
// kMaxVocab.
inline constexpr std::string_view kSyntheticEndOfText = "<|endoftext|>";
Result<std::unique_ptr<gguf::GgufFile>> SyntheticVocabularyFile(int64_t vocab_size);

}  // namespace shadowkv

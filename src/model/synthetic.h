// Shapes of well-known models for synthetic-weight runs: random weights, real sizes. Decode
// throughput does not depend on weight values, but every output made this way must say so.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "model/config.h"

namespace shadowkv {

// The label every synthetic-weight result carries.
inline constexpr std::string_view kSyntheticLabel =
    "SYNTHETIC WEIGHTS (random values, real shapes): throughput only, outputs are meaningless";

// Names SyntheticModelConfig knows, e.g. "llama3-8b".
std::vector<std::string> SyntheticModelNames();

// The config of a named model (architecture, sizes, RoPE); kNotFound lists the known names.
Result<ModelConfig> SyntheticModelConfig(std::string_view name);

}  // namespace shadowkv

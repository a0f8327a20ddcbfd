// The 1 MiB text that the tokenizer model test round-trips and the tokenizer bench times.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace shadowkv::testing {

// Every case text of a tokenizer golden file (tests/data/goldens/tokenizer_*.json), one per line,
// repeated until at least 1 MiB: prose, code, numbers, every script and special-token edge that
// the goldens cover, in the proportions they have there.
inline std::string GoldenTextsToAMegabyte(const std::string& golden_json) {
  const nlohmann::json golden = nlohmann::json::parse(golden_json);
  std::string mixed;
  for (const auto& test_case : golden["cases"]) {
    mixed += test_case["text"].get<std::string>();
    mixed += "\n";
  }
  std::string text;
  while (!mixed.empty() && text.size() < (1u << 20)) text += mixed;
  return text;
}

}  // namespace shadowkv::testing

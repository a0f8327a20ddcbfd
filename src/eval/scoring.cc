// RULER's string-match metrics.
#include "eval/scoring.h"

#include <algorithm>
#include <cctype>

namespace shadowkv::eval {
namespace {

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool Contains(const std::string& lower_text, std::string_view reference) {
  return lower_text.find(Lower(reference)) != std::string::npos;
}

}  // namespace

std::string CleanPrediction(std::string_view prediction) {
  std::string out(prediction);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  }
  const auto is_space = [](unsigned char c) { return std::isspace(c) != 0; };
  const auto first = std::find_if_not(out.begin(), out.end(), is_space);
  const auto last = std::find_if_not(out.rbegin(), out.rend(), is_space).base();
  return first < last ? std::string(first, last) : std::string();
}

double StringMatchAll(std::string_view prediction, std::span<const std::string> references) {
  if (references.empty()) return 0.0;
  const std::string text = Lower(prediction);
  int found = 0;
  for (const std::string& reference : references) found += Contains(text, reference) ? 1 : 0;
  return static_cast<double>(found) / static_cast<double>(references.size());
}

double StringMatchPart(std::string_view prediction, std::span<const std::string> references) {
  const std::string text = Lower(prediction);
  for (const std::string& reference : references) {
    if (Contains(text, reference)) return 1.0;
  }
  return 0.0;
}

double Score(Metric metric, std::string_view prediction, std::span<const std::string> references) {
  const std::string cleaned = CleanPrediction(prediction);
  return metric == Metric::kStringMatchPart ? StringMatchPart(cleaned, references)
                                            : StringMatchAll(cleaned, references);
}

}  // namespace shadowkv::eval

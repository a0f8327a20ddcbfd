// RULER's scoring: the prediction is cleaned up, then expected strings are looked for in it,
// ignoring case.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "eval/tasks.h"

namespace shadowkv::eval {

// RULER's post-processing: control characters become newlines, outer whitespace is dropped.
std::string CleanPrediction(std::string_view prediction);

// Fraction of `references` found in the prediction (case-insensitive), in [0, 1].
double StringMatchAll(std::string_view prediction, std::span<const std::string> references);
// 1 when any of `references` is found in the prediction (case-insensitive), else 0.
double StringMatchPart(std::string_view prediction, std::span<const std::string> references);

// The metric applied to the cleaned prediction.
double Score(Metric metric, std::string_view prediction, std::span<const std::string> references);

}  // namespace shadowkv::eval

// StopMatcher: finds stop sequences in streamed text, holding back what may begin one.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace shadowkv::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Adds generated text; returns the text now safe to emit. Once a stop sequence appears,
  // stopped() is true and nothing from the stop sequence on is ever emitted.
  std::string Push(std::string_view text);
  // The text still held back (at the end of generation it is emitted as is).
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;  // text that might be the start of a stop sequence
  bool stopped_ = false;
};

}  // namespace shadowkv::server

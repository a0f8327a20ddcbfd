// StopMatcher: the earliest stop sequence wins; the longest possible partial match is held.
#include "server/stop_matcher.h"

#include <algorithm>

namespace shadowkv::server {

std::string StopMatcher::Push(std::string_view text) {
  if (stopped_) return "";
  held_.append(text);
  size_t first = std::string::npos;
  for (const std::string& stop : stops_) first = std::min(first, held_.find(stop));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Keep the longest suffix of held_ that is a proper prefix of some stop sequence.
  size_t keep = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, held_.size());
    for (size_t length = longest; length > keep; --length) {
      if (std::string_view(held_).substr(held_.size() - length) ==
          std::string_view(stop).substr(0, length)) {
        keep = length;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::Flush() {
  std::string out = stopped_ ? "" : held_;
  held_.clear();
  return out;
}

}  // namespace shadowkv::server

// PrefixCache: linear scan (a few dozen states at most), exact token-prefix match.
#include "engine/prefix_cache.h"

#include <algorithm>

namespace shadowkv::engine {

std::optional<HeldState> PrefixCache::Take(const std::string& policy_key,
                                           std::span<const int32_t> prompt) {
  auto best = states_.end();
  for (auto it = states_.begin(); it != states_.end(); ++it) {
    if (it->policy_key != policy_key || it->tokens.empty() || it->tokens.size() >= prompt.size()) {
      continue;
    }
    if (best != states_.end() && best->tokens.size() >= it->tokens.size()) continue;
    if (std::equal(it->tokens.begin(), it->tokens.end(), prompt.begin())) best = it;
  }
  if (best == states_.end()) return std::nullopt;
  if (auto fork = best->kv->Fork(); fork.ok()) {
    states_.splice(states_.begin(), states_, best);  // now the most recently used
    HeldState copy;
    copy.policy_key = best->policy_key;
    copy.tokens = best->tokens;
    copy.kv = std::move(fork).value();
    copy.reported = best->reported;
    copy.copy = true;
    return copy;
  }
  HeldState state = std::move(*best);
  states_.erase(best);
  return state;
}

void PrefixCache::Put(HeldState state) {
  if (max_states_ <= 0) return;
  states_.push_front(std::move(state));
  while (static_cast<int>(states_.size()) > max_states_) states_.pop_back();
}

bool PrefixCache::EvictOldest() {
  if (states_.empty()) return false;
  states_.pop_back();
  return true;
}

kv::MemoryUsage PrefixCache::memory() const {
  kv::MemoryUsage total;
  for (const HeldState& s : states_) total += s.kv->memory();
  return total;
}

}  // namespace shadowkv::engine

// PrefixCache: finished sequences' KV states held for reuse by a later prompt that extends them.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_policy.h"

namespace shadowkv::engine {

struct HeldState {
  std::string policy_key;       // states are reused only under the same KV settings
  std::vector<int32_t> tokens;  // the tokens the KV state holds, in order
  std::unique_ptr<kv::SequenceKv> kv;
  kv::PolicyStats reported;  // the state's statistics already counted in the metrics
  bool copy = false;         // from Take: a fork of a state that stays held
};

// Least-recently-used list of held states. Not thread-safe: the engine loop owns it.
class PrefixCache {
 public:
  explicit PrefixCache(int max_states) : max_states_(max_states) {}

  // The state under `policy_key` whose tokens are the longest proper prefix of `prompt` (at
  // least one prompt token must remain to be run); nullopt when none is. A state whose
  // sequence forks stays held and the request gets the copy (`copy` set), so one held prompt
  // serves any number of requests; otherwise it is removed, in use by one request, and comes
  // back through Put when that finishes.
  std::optional<HeldState> Take(const std::string& policy_key, std::span<const int32_t> prompt);
  // Holds a state as the most recently used, evicting the oldest beyond max_states.
  void Put(HeldState state);
  // Drops the least recently used state; false when there is none.
  bool EvictOldest();
  void Clear() { states_.clear(); }

  size_t size() const { return states_.size(); }
  kv::MemoryUsage memory() const;

 private:
  int max_states_;
  std::list<HeldState> states_;  // most recently used first
};

}  // namespace shadowkv::engine

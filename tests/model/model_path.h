// Where model tests find the default real model: $SHADOWKV_MODEL, else the fetch script's cache.
#pragma once

#include <cstdlib>
#include <string>

namespace shadowkv::testing {

inline std::string DefaultModelPath() {
  if (const char* env = std::getenv("SHADOWKV_MODEL"); env && *env) return env;
  std::string cache;
  if (const char* env = std::getenv("SHADOWKV_CACHE"); env && *env) {
    cache = env;
  } else {
    const char* home = std::getenv("HOME");
    cache = std::string(home ? home : ".") + "/.cache/shadowkv";
  }
  return cache + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// Repository data files (tests/data/...).
inline std::string DataPath(const std::string& relative) {
  return std::string(SHADOWKV_SOURCE_DIR) + "/tests/data/" + relative;
}

}  // namespace shadowkv::testing

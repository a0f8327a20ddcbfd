// OpenAI-style request bodies: parsing and validation of /v1/completions and /v1/chat/completions.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "format/chat_template.h"

namespace shadowkv::server {

// An error as the API reports it: an HTTP status and OpenAI's error object.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field; empty: none
  std::string code;   // machine-readable reason; empty: none
};

// {"error": {"message", "type", "param", "code"}} (param/code null when empty).
nlohmann::json ErrorBody(const ApiError& error);

enum class Endpoint { kCompletions, kChatCompletions };

// What a request asks for, before tokenisation.
struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  std::string prompt;                  // completions: the text
  std::vector<int32_t> prompt_tokens;  // completions: token ids given instead of text
  std::vector<ChatMessage> messages;   // chat
  std::optional<int64_t> max_tokens;   // absent: the server's default
  SamplingParams sampling;
  bool seed_given = false;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Extensions (not in OpenAI's API).
  std::optional<std::string> kv_policy;
  std::optional<int64_t> kv_budget;
  bool kv_reuse = true;
  bool ignore_eos = false;
};

// Bounds the parser enforces on numbers and lists (the context checks come after tokenising).
struct ParseLimits {
  int64_t max_tokens_limit = 1 << 20;  // larger values are rejected outright
  int max_stop_sequences = 4;
  size_t max_stop_length = 256;  // bytes per stop sequence
  size_t max_messages = 1024;
};

// Parses `body` into *request; returns the error to send instead when it is not acceptable.
// Known fields of the wrong type or out of range are errors, and so are OpenAI fields this server
// does not implement unless their value asks for nothing (code "unsupported", docs/SERVER.md
// lists them); fields it does not know at all are ignored.
std::optional<ApiError> ParseApiRequest(std::string_view body, Endpoint endpoint,
                                        const ParseLimits& limits, ApiRequest* request);

}  // namespace shadowkv::server

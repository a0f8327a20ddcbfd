// OpenAI-style response bodies: whole completions, streamed chunks, usage.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "server/api_request.h"

namespace shadowkv::server {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from a held KV state
};

// Identity of one response: the same in every chunk of a stream.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;
  std::string model;
};

nlohmann::json UsageObject(const Usage& usage);
// A non-streamed response: text plus finish_reason ("stop" | "length").
nlohmann::json CompletionObject(const ResponseMeta& meta, const std::string& text,
                                const std::string& finish_reason, const Usage& usage);
// One streamed chunk. Chat: `role_chunk` opens the stream with the assistant role; a chunk with
// a finish reason carries an empty delta. Completions: text plus finish_reason.
nlohmann::json ChunkObject(const ResponseMeta& meta, const std::string& text,
                           const std::string& finish_reason, bool role_chunk = false);
// The final usage chunk of a stream (stream_options.include_usage): no choices.
nlohmann::json UsageChunkObject(const ResponseMeta& meta, const Usage& usage);
// "data: <json>\n\n"
std::string SseEvent(const nlohmann::json& body);

}  // namespace shadowkv::server

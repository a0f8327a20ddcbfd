// Response bodies in the shapes the OpenAI API documents (and its official clients parse).
#include "server/api_response.h"

namespace shadowkv::server {

using Json = nlohmann::json;

namespace {

const char* ObjectName(Endpoint endpoint, bool chunk) {
  if (endpoint == Endpoint::kCompletions) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}

Json Reason(const std::string& finish_reason) {
  return finish_reason.empty() ? Json(nullptr) : Json(finish_reason);
}

Json Envelope(const ResponseMeta& meta, bool chunk) {
  return {{"id", meta.id},
          {"object", ObjectName(meta.endpoint, chunk)},
          {"created", meta.created},
          {"model", meta.model},
          {"system_fingerprint", nullptr}};
}

}  // namespace

Json UsageObject(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens}}}};
}

Json CompletionObject(const ResponseMeta& meta, const std::string& text,
                      const std::string& finish_reason, const Usage& usage) {
  Json body = Envelope(meta, false);
  Json choice = {{"index", 0}, {"finish_reason", Reason(finish_reason)}, {"logprobs", nullptr}};
  if (meta.endpoint == Endpoint::kChatCompletions) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  body["choices"] = Json::array({choice});
  body["usage"] = UsageObject(usage);
  return body;
}

Json ChunkObject(const ResponseMeta& meta, const std::string& text,
                 const std::string& finish_reason, bool role_chunk) {
  Json body = Envelope(meta, true);
  Json choice = {{"index", 0}, {"finish_reason", Reason(finish_reason)}, {"logprobs", nullptr}};
  if (meta.endpoint == Endpoint::kChatCompletions) {
    Json delta = Json::object();
    if (role_chunk) delta["role"] = "assistant";
    if (role_chunk || !text.empty()) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  body["choices"] = Json::array({choice});
  return body;
}

Json UsageChunkObject(const ResponseMeta& meta, const Usage& usage) {
  Json body = Envelope(meta, true);
  body["choices"] = Json::array();
  body["usage"] = UsageObject(usage);
  return body;
}

std::string SseEvent(const Json& body) {
  // Invalid UTF-8 cannot reach here (inputs are validated, outputs come from the decoder), but
  // replacing keeps a stream alive rather than throwing mid-response.
  return "data: " + body.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

}  // namespace shadowkv::server

// Request parsing: every known field checked for type and range, errors naming the field.
#include "server/api_request.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "kv/kv_config.h"

namespace shadowkv::server {

nlohmann::json ErrorBody(const ApiError& error) {
  nlohmann::json e = {{"message", error.message}, {"type", error.type}};
  e["param"] = error.param.empty() ? nlohmann::json(nullptr) : nlohmann::json(error.param);
  e["code"] = error.code.empty() ? nlohmann::json(nullptr) : nlohmann::json(error.code);
  return {{"error", e}};
}

namespace {

using Json = nlohmann::json;

ApiError Invalid(const std::string& param, std::string message, std::string code = "") {
  return ApiError{400, std::move(message), "invalid_request_error", param, std::move(code)};
}

// The field or null when absent or JSON null (OpenAI treats null as "not given").
const Json* Field(const Json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> ReadInteger(const Json& object, const char* name, int64_t min, int64_t max,
                                    std::optional<int64_t>* out) {
  const Json* v = Field(object, name);
  if (!v) return std::nullopt;
  // Integral floats (2.0) are accepted as clients write them; 1e300 or 2.5 are not.
  int64_t value = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(max)) {
      return Invalid(name, fmt::format("'{}' must be an integer in [{}, {}]", name, min, max),
                     "integer_out_of_range");
    }
    value = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || std::fabs(d) > 9.0e15) {
      return Invalid(name, fmt::format("'{}' must be an integer in [{}, {}]", name, min, max),
                     "integer_out_of_range");
    }
    if (d != std::floor(d)) {
      return Invalid(name, fmt::format("'{}' must be an integer, not {}", name, d), "invalid_type");
    }
    value = static_cast<int64_t>(d);
  } else {
    return Invalid(name, fmt::format("'{}' must be an integer, not {}", name, v->type_name()),
                   "invalid_type");
  }
  if (value < min || value > max) {
    return Invalid(name, fmt::format("'{}' is {}; it must be in [{}, {}]", name, value, min, max),
                   "integer_out_of_range");
  }
  *out = value;
  return std::nullopt;
}

std::optional<ApiError> ReadNumber(const Json& object, const char* name, double min, double max,
                                   std::optional<double>* out) {
  const Json* v = Field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) {
    return Invalid(name, fmt::format("'{}' must be a number, not {}", name, v->type_name()),
                   "invalid_type");
  }
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < min || d > max) {
    return Invalid(name, fmt::format("'{}' is {}; it must be in [{}, {}]", name, d, min, max),
                   "number_out_of_range");
  }
  *out = d;
  return std::nullopt;
}

std::optional<ApiError> ReadBool(const Json& object, const char* name, bool* out) {
  const Json* v = Field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) {
    return Invalid(name, fmt::format("'{}' must be a boolean, not {}", name, v->type_name()),
                   "invalid_type");
  }
  *out = v->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> ReadString(const Json& object, const char* name,
                                   std::optional<std::string>* out) {
  const Json* v = Field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) {
    return Invalid(name, fmt::format("'{}' must be a string, not {}", name, v->type_name()),
                   "invalid_type");
  }
  *out = v->get<std::string>();
  return std::nullopt;
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts.
std::optional<ApiError> ReadContent(const Json& content, const std::string& param,
                                    std::string* out) {
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (content.is_array()) {
    out->clear();
    for (size_t i = 0; i < content.size(); ++i) {
      const Json& part = content[i];
      const std::string part_param = fmt::format("{}[{}]", param, i);
      const Json* type = part.is_object() ? Field(part, "type") : nullptr;
      if (type && type->is_string() && *type != "text") {
        return Invalid(part_param,
                       fmt::format("content parts of type '{}' are not supported (only text)",
                                   type->get<std::string>()),
                       "unsupported");
      }
      const Json* text = part.is_object() ? Field(part, "text") : nullptr;
      if (!type || !text || !text->is_string()) {
        return Invalid(part_param, "content parts must be {\"type\": \"text\", \"text\": string}",
                       "invalid_type");
      }
      *out += text->get<std::string>();
    }
    return std::nullopt;
  }
  return Invalid(param,
                 fmt::format("'content' must be a string or an array of text parts, not {}",
                             content.type_name()),
                 "invalid_type");
}

std::optional<ApiError> ReadMessages(const Json& body, const ParseLimits& limits,
                                     std::vector<ChatMessage>* out) {
  const Json* messages = Field(body, "messages");
  if (!messages) return Invalid("messages", "'messages' is required", "missing_required_parameter");
  if (!messages->is_array()) {
    return Invalid("messages",
                   fmt::format("'messages' must be an array, not {}", messages->type_name()),
                   "invalid_type");
  }
  if (messages->empty()) return Invalid("messages", "'messages' is empty");
  if (messages->size() > limits.max_messages) {
    return Invalid("messages", fmt::format("more than {} messages", limits.max_messages));
  }
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) return Invalid(param, "each message must be an object", "invalid_type");
    const Json* role = Field(m, "role");
    if (!role || !role->is_string()) {
      return Invalid(param + ".role", "each message needs a string 'role'", "invalid_type");
    }
    const std::string r = role->get<std::string>();
    if (r == "tool" || r == "function") {
      return Invalid(param + ".role",
                     fmt::format("role '{}' is not supported: this server does not call tools", r),
                     "unsupported");
    }
    if (r != "system" && r != "user" && r != "assistant" && r != "developer") {
      return Invalid(param + ".role",
                     fmt::format("role '{}' is not one of system, developer, user, assistant", r),
                     "invalid_value");
    }
    // Fields the templates have no place for: dropping them would change the conversation.
    for (const char* name : {"name", "tool_calls", "function_call", "tool_call_id", "audio"}) {
      if (Field(m, name)) {
        return Invalid(param + "." + name, fmt::format("message field '{}' is not supported", name),
                       "unsupported");
      }
    }
    ChatMessage message;
    message.role = r == "developer" ? "system" : r;
    const Json* content = Field(m, "content");
    if (!content)
      return Invalid(param + ".content", "each message needs 'content'", "invalid_type");
    if (auto error = ReadContent(*content, param + ".content", &message.content)) return error;
    out->push_back(std::move(message));
  }
  return std::nullopt;
}

// completions: a string, an array holding one string, or an array of token ids.
std::optional<ApiError> ReadPrompt(const Json& body, ApiRequest* request) {
  const Json* prompt = Field(body, "prompt");
  if (!prompt) return Invalid("prompt", "'prompt' is required", "missing_required_parameter");
  if (prompt->is_string()) {
    request->prompt = prompt->get<std::string>();
    return std::nullopt;
  }
  if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
    request->prompt = (*prompt)[0].get<std::string>();
    return std::nullopt;
  }
  if (prompt->is_array() && !prompt->empty()) {
    for (const Json& id : *prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return Invalid("prompt",
                       "'prompt' must be a string, an array of one string, or an array of token "
                       "ids (batches of prompts are not supported)",
                       "invalid_type");
      }
      request->prompt_tokens.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return std::nullopt;
  }
  return Invalid("prompt",
                 fmt::format("'prompt' must be a string or an array, not {}", prompt->type_name()),
                 "invalid_type");
}

std::optional<ApiError> ReadStop(const Json& body, const ParseLimits& limits,
                                 std::vector<std::string>* out) {
  const Json* stop = Field(body, "stop");
  if (!stop) return std::nullopt;
  if (stop->is_string()) {
    out->push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (const Json& s : *stop) {
      if (!s.is_string()) return Invalid("stop", "'stop' entries must be strings", "invalid_type");
      out->push_back(s.get<std::string>());
    }
  } else {
    return Invalid("stop", "'stop' must be a string or an array of strings", "invalid_type");
  }
  if (static_cast<int>(out->size()) > limits.max_stop_sequences) {
    return Invalid("stop", fmt::format("at most {} stop sequences", limits.max_stop_sequences));
  }
  for (const std::string& s : *out) {
    if (s.empty()) return Invalid("stop", "stop sequences must not be empty");
    if (s.size() > limits.max_stop_length) {
      return Invalid("stop",
                     fmt::format("stop sequences are limited to {} bytes", limits.max_stop_length));
    }
  }
  return std::nullopt;
}

// A field this server does not implement, with the values that ask for nothing.
struct UnsupportedField {
  const char* name;
  bool (*is_neutral)(const Json& value);
  const char* neutral;  // the accepted values, for the message; nullptr: only null
};

bool IsZero(const Json& v) { return v.is_number() && v.get<double>() == 0.0; }
bool IsOne(const Json& v) { return v.is_number() && v.get<double>() == 1.0; }
bool IsFalse(const Json& v) { return v == false || (v.is_number_integer() && v == 0); }
// Json::empty() is false for every string, so strings are checked by their text.
bool IsEmpty(const Json& v) {
  if (v.is_string()) return v.get_ref<const std::string&>().empty();
  return (v.is_array() || v.is_object()) && v.empty();
}
bool IsNothing(const Json&) { return false; }

// Each refused by name unless it asks for nothing: ignoring it would answer 200 with something
// other than what was asked. Sampling fields of other servers are listed too, for the same
// reason. Null means absent, as for every field.
constexpr UnsupportedField kUnsupportedFields[] = {
    {"n", IsOne, "1"},
    {"best_of", IsOne, "1"},
    {"presence_penalty", IsZero, "0"},
    {"frequency_penalty", IsZero, "0"},
    {"logprobs", IsFalse, "false or 0"},
    {"top_logprobs", IsZero, "0"},
    {"echo", IsFalse, "false"},
    {"suffix", IsEmpty, "\"\""},
    {"logit_bias", IsEmpty, "{}"},
    {"response_format",
     [](const Json& v) { return v.is_object() && v.size() == 1 && v.value("type", "") == "text"; },
     "{\"type\": \"text\"}"},
    {"tools", IsEmpty, "[]"},
    {"functions", IsEmpty, "[]"},
    {"tool_choice", [](const Json& v) { return v == "none" || v == "auto"; },
     "\"none\" or \"auto\" (with no tools)"},
    {"function_call", [](const Json& v) { return v == "none" || v == "auto"; },
     "\"none\" or \"auto\" (with no functions)"},
    {"parallel_tool_calls", [](const Json& v) { return v.is_boolean(); },
     "a boolean (with no tools)"},
    {"modalities", [](const Json& v) { return v == Json::array({"text"}); }, "[\"text\"]"},
    {"store", IsFalse, "false"},
    {"audio", IsNothing, nullptr},
    {"prediction", IsNothing, nullptr},
    {"web_search_options", IsNothing, nullptr},
    {"reasoning_effort", IsNothing, nullptr},
    {"verbosity", IsNothing, nullptr},
    {"min_p", IsZero, "0"},
    {"typical_p", IsOne, "1"},
    {"repetition_penalty", IsOne, "1"},
    {"min_tokens", IsZero, "0"},
    {"grammar", IsNothing, nullptr},
    {"json_schema", IsNothing, nullptr},
    {"guided_json", IsNothing, nullptr},
    {"guided_regex", IsNothing, nullptr},
    {"guided_choice", IsNothing, nullptr},
    {"guided_grammar", IsNothing, nullptr},
};

std::optional<ApiError> RefuseUnsupportedFields(const Json& body) {
  for (const UnsupportedField& field : kUnsupportedFields) {
    const Json* v = Field(body, field.name);
    if (!v || field.is_neutral(*v)) continue;
    return Invalid(field.name,
                   field.neutral ? fmt::format("'{}' is not supported (accepted only as {})",
                                               field.name, field.neutral)
                                 : fmt::format("'{}' is not supported", field.name),
                   "unsupported");
  }
  // Metadata that does not change the output: accepted, but only in its documented type.
  for (const char* name : {"user", "service_tier", "prompt_cache_key", "safety_identifier"}) {
    std::optional<std::string> ignored;
    if (auto e = ReadString(body, name, &ignored)) return e;
  }
  if (const Json* metadata = Field(body, "metadata"); metadata && !metadata->is_object()) {
    return Invalid("metadata", "'metadata' must be an object", "invalid_type");
  }
  return std::nullopt;
}

std::optional<ApiError> ParseObject(const Json& body, Endpoint endpoint, const ParseLimits& limits,
                                    ApiRequest* r) {
  r->endpoint = endpoint;
  std::optional<std::string> model;
  if (auto e = ReadString(body, "model", &model)) return e;
  r->model = model.value_or("");
  if (endpoint == Endpoint::kChatCompletions) {
    if (auto e = ReadMessages(body, limits, &r->messages)) return e;
  } else {
    if (auto e = ReadPrompt(body, r)) return e;
  }
  std::optional<int64_t> max_tokens;
  if (auto e = ReadInteger(body, "max_tokens", 1, limits.max_tokens_limit, &max_tokens)) return e;
  if (!max_tokens) {
    if (auto e =
            ReadInteger(body, "max_completion_tokens", 1, limits.max_tokens_limit, &max_tokens)) {
      return e;
    }
  }
  r->max_tokens = max_tokens;

  std::optional<double> temperature, top_p;
  if (auto e = ReadNumber(body, "temperature", 0.0, 2.0, &temperature)) return e;
  if (auto e = ReadNumber(body, "top_p", 0.0, 1.0, &top_p)) return e;
  if (top_p && *top_p <= 0.0) return Invalid("top_p", "'top_p' must be above 0");
  std::optional<int64_t> top_k, seed;
  if (auto e = ReadInteger(body, "top_k", 0, 1 << 30, &top_k)) return e;
  if (auto e = ReadInteger(body, "seed", INT64_MIN, INT64_MAX, &seed)) return e;
  r->sampling.temperature = static_cast<float>(temperature.value_or(1.0));
  r->sampling.top_p = static_cast<float>(top_p.value_or(1.0));
  r->sampling.top_k = static_cast<int>(top_k.value_or(0));
  r->seed_given = seed.has_value();
  r->sampling.seed = static_cast<uint64_t>(seed.value_or(0));
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    std::optional<double> penalty;
    if (auto e = ReadNumber(body, name, -2.0, 2.0, &penalty)) return e;
  }
  if (auto e = RefuseUnsupportedFields(body)) return e;
  if (auto e = ReadStop(body, limits, &r->stop)) return e;
  if (auto e = ReadBool(body, "stream", &r->stream)) return e;
  if (const Json* options = Field(body, "stream_options")) {
    if (!options->is_object()) {
      return Invalid("stream_options", "'stream_options' must be an object", "invalid_type");
    }
    if (auto e = ReadBool(*options, "include_usage", &r->include_usage)) return e;
  }

  std::optional<std::string> policy;
  if (auto e = ReadString(body, "kv_policy", &policy)) return e;
  if (policy) {
    const auto& known = kv::KnownKvPolicies();
    if (std::find(known.begin(), known.end(), *policy) == known.end()) {
      return Invalid(
          "kv_policy",
          fmt::format("unknown KV policy '{}' (known: {})", *policy, fmt::join(known, ", ")),
          "invalid_value");
    }
    r->kv_policy = policy;
  }
  std::optional<int64_t> budget;
  if (auto e = ReadInteger(body, "kv_budget", 0, 1 << 30, &budget)) return e;
  r->kv_budget = budget;
  if (auto e = ReadBool(body, "kv_reuse", &r->kv_reuse)) return e;
  if (auto e = ReadBool(body, "ignore_eos", &r->ignore_eos)) return e;
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseApiRequest(std::string_view body, Endpoint endpoint,
                                        const ParseLimits& limits, ApiRequest* request) {
  // The lexer rejects ill-formed UTF-8 inside strings, so every accepted text is valid UTF-8.
  // Its exception is caught here: its message names the offending byte and what was expected.
  Json parsed;
  try {
    parsed = Json::parse(body);
  } catch (const Json::exception& e) {
    return ApiError{400, std::string("the request body is not valid JSON: ") + e.what(),
                    "invalid_request_error", "", "invalid_json"};
  }
  if (!parsed.is_object()) {
    return ApiError{400, "the request body must be a JSON object", "invalid_request_error", "",
                    "invalid_json"};
  }
  *request = ApiRequest{};
  return ParseObject(parsed, endpoint, limits, request);
}

}  // namespace shadowkv::server

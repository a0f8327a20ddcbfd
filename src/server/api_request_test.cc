// Request parsing: accepted shapes, and every kind of bad field named with a 400.
#include "server/api_request.h"

#include <gtest/gtest.h>

namespace shadowkv::server {
namespace {

std::optional<ApiError> Parse(std::string_view body, Endpoint endpoint, ApiRequest* out) {
  return ParseApiRequest(body, endpoint, ParseLimits{}, out);
}

// Parses a completions body expected to fail and returns the error.
ApiError Fails(std::string_view body, Endpoint endpoint = Endpoint::kCompletions) {
  ApiRequest request;
  auto error = Parse(body, endpoint, &request);
  EXPECT_TRUE(error.has_value()) << body;
  return error.value_or(ApiError{});
}

TEST(ApiRequestTest, ChatRequestWithEveryField) {
  ApiRequest r;
  const auto error = Parse(R"({"model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
      "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 42, "stop": ["\n", "END"],
      "stream": true, "stream_options": {"include_usage": true}, "kv_policy": "shadowkv",
      "kv_budget": 64, "kv_reuse": false, "unknown_field": {"a": 1}})",
                           Endpoint::kChatCompletions, &r);
  ASSERT_FALSE(error.has_value()) << error->message;
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "Hi there");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(*r.kv_policy, "shadowkv");
  EXPECT_EQ(*r.kv_budget, 64);
  EXPECT_FALSE(r.kv_reuse);
}

TEST(ApiRequestTest, CompletionDefaultsFollowOpenAi) {
  ApiRequest r;
  ASSERT_FALSE(
      Parse(R"({"prompt": "abc", "max_tokens": null, "stop": "x"})", Endpoint::kCompletions, &r));
  EXPECT_EQ(r.prompt, "abc");
  EXPECT_FALSE(r.max_tokens.has_value());  // null means absent
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_FALSE(r.stream);
  EXPECT_TRUE(r.kv_reuse);
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
  ASSERT_FALSE(Parse(R"({"prompt": ["one"], "max_tokens": 3.0})", Endpoint::kCompletions, &r));
  EXPECT_EQ(r.prompt, "one");
  EXPECT_EQ(*r.max_tokens, 3);
  ASSERT_FALSE(Parse(R"({"prompt": [1, 2, 3]})", Endpoint::kCompletions, &r));
  EXPECT_EQ(r.prompt_tokens, (std::vector<int32_t>{1, 2, 3}));
  ASSERT_FALSE(Parse(R"({"messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": 5})",
                     Endpoint::kChatCompletions, &r));
  EXPECT_EQ(*r.max_tokens, 5);
}

TEST(ApiRequestTest, MalformedBodies) {
  for (const char* body : {"", "{", "{\"prompt\": \"a\"", "not json", "{\"prompt\": 'a'}",
                           "{\"prompt\": \"a\"} trailing"}) {
    const ApiError e = Fails(body);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.code, "invalid_json") << body;
  }
  EXPECT_EQ(Fails("[1, 2]").code, "invalid_json");
  EXPECT_EQ(Fails("\"text\"").code, "invalid_json");
}

TEST(ApiRequestTest, InvalidUtf8IsRejected) {
  // A lone continuation byte, an overlong encoding, and a truncated sequence inside strings.
  for (std::string bad : {"\x80", "\xC0\xAF", "\xE2\x82"}) {
    const ApiError e = Fails("{\"prompt\": \"a" + bad + "b\"}");
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.code, "invalid_json");
    EXPECT_NE(e.message.find("UTF-8"), std::string::npos) << e.message;
  }
}

TEST(ApiRequestTest, WrongTypesNameTheField) {
  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": {"a": 1}})", "prompt"},
      {R"({"prompt": [1, "x"]})", "prompt"},
      {R"({"prompt": "a", "max_tokens": "10"})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 2.5})", "max_tokens"},
      {R"({"prompt": "a", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "a", "stream": "yes"})", "stream"},
      {R"({"prompt": "a", "stop": 3})", "stop"},
      {R"({"prompt": "a", "stop": ["a", 1]})", "stop"},
      {R"({"prompt": "a", "model": 1})", "model"},
      {R"({"prompt": "a", "stream_options": 1})", "stream_options"},
      {R"({"prompt": "a", "kv_policy": 3})", "kv_policy"},
      {R"({"prompt": "a", "kv_reuse": "no"})", "kv_reuse"},
  };
  for (const Case& c : cases) {
    const ApiError e = Fails(c.body);
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
  }
  EXPECT_EQ(Fails(R"({"messages": "hi"})", Endpoint::kChatCompletions).param, "messages");
  EXPECT_EQ(Fails(R"({"messages": [{"role": "user"}]})", Endpoint::kChatCompletions).param,
            "messages[0].content");
  EXPECT_EQ(
      Fails(R"({"messages": [{"role": "robot", "content": "x"}]})", Endpoint::kChatCompletions)
          .param,
      "messages[0].role");
  EXPECT_EQ(
      Fails(R"({"messages": [{"role": "user", "content": 7}]})", Endpoint::kChatCompletions).param,
      "messages[0].content");
  EXPECT_EQ(Fails(R"({"messages": []})", Endpoint::kChatCompletions).param, "messages");
  EXPECT_EQ(Fails(R"({"max_tokens": 3})", Endpoint::kChatCompletions).code,
            "missing_required_parameter");
}

TEST(ApiRequestTest, NumbersOutOfRange) {
  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"prompt": "a", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": -5})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 99999999999999999999999})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 18446744073709551615})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 1e300})", "max_tokens"},
      {R"({"prompt": "a", "temperature": -0.1})", "temperature"},
      {R"({"prompt": "a", "temperature": 1e308})", "temperature"},
      {R"({"prompt": "a", "top_p": 0})", "top_p"},
      {R"({"prompt": "a", "top_p": 1.5})", "top_p"},
      {R"({"prompt": "a", "n": 2})", "n"},
      {R"({"prompt": "a", "kv_budget": -1})", "kv_budget"},
      {R"({"prompt": "a", "presence_penalty": 1})", "presence_penalty"},
      {R"({"prompt": "a", "logprobs": 3})", "logprobs"},
      {R"({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]})", "stop"},
      {R"({"prompt": "a", "stop": [""]})", "stop"},
      {R"({"prompt": "a", "kv_policy": "magic"})", "kv_policy"},
  };
  for (const Case& c : cases) {
    const ApiError e = Fails(c.body);
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
  }
}

TEST(ApiRequestTest, ErrorCodesTellRangeFromType) {
  EXPECT_EQ(Fails(R"({"prompt": "a", "max_tokens": 1e300})").code, "integer_out_of_range");
  EXPECT_EQ(Fails(R"({"prompt": "a", "max_tokens": 99999999999999999999})").code,
            "integer_out_of_range");
  EXPECT_EQ(Fails(R"({"prompt": "a", "max_tokens": -1})").code, "integer_out_of_range");
  EXPECT_EQ(Fails(R"({"prompt": "a", "max_tokens": 2.5})").code, "invalid_type");
  EXPECT_EQ(Fails(R"({"prompt": "a", "max_tokens": true})").code, "invalid_type");
  EXPECT_EQ(Fails(R"({"prompt": "a", "temperature": 3})").code, "number_out_of_range");
}

TEST(ApiRequestTest, UnsupportedFieldsAreRefusedByName) {
  struct Case {
    const char* field;
    const char* value;
  } cases[] = {
      {"tools", R"([{"type": "function", "function": {"name": "f"}}])"},
      {"tool_choice", R"("required")"},
      {"tool_choice", R"({"type": "function", "function": {"name": "f"}})"},
      {"functions", R"([{"name": "f"}])"},
      {"function_call", R"({"name": "f"})"},
      {"parallel_tool_calls", R"("yes")"},
      {"response_format", R"({"type": "json_object"})"},
      {"response_format", R"({"type": "json_schema", "json_schema": {}})"},
      {"response_format", R"("text")"},
      {"logit_bias", R"({"50256": -100})"},
      {"best_of", "2"},
      {"suffix", R"("tail")"},
      {"top_logprobs", "3"},
      {"logprobs", "true"},
      {"logprobs", "2"},
      {"logprobs", R"("yes")"},
      {"echo", "true"},
      {"n", "2"},
      {"n", R"("1")"},
      {"presence_penalty", "0.5"},
      {"frequency_penalty", "-1"},
      {"modalities", R"(["text", "audio"])"},
      {"audio", R"({"voice": "alloy"})"},
      {"store", "true"},
      {"prediction", R"({"type": "content", "content": "x"})"},
      {"reasoning_effort", R"("low")"},
      {"web_search_options", "{}"},
      {"min_p", "0.1"},
      {"repetition_penalty", "1.2"},
      {"grammar", R"("root ::= \"a\"")"},
  };
  for (const Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    const std::string head = endpoint == Endpoint::kCompletions
                                 ? R"({"prompt": "a", ")"
                                 : R"({"messages": [{"role": "user", "content": "a"}], ")";
    for (const Case& c : cases) {
      const std::string body = head + c.field + "\": " + c.value + "}";
      const ApiError e = Fails(body, endpoint);
      EXPECT_EQ(e.http_status, 400) << body;
      EXPECT_EQ(e.param, c.field) << body;
      EXPECT_EQ(e.code, "unsupported") << body;
      EXPECT_NE(e.message.find(std::string("'") + c.field + "'"), std::string::npos) << e.message;
    }
  }
  EXPECT_EQ(Fails(R"({"prompt": "a", "response_format": {"type": "json_object"}})").message,
            "'response_format' is not supported (accepted only as {\"type\": \"text\"})");
}

TEST(ApiRequestTest, NeutralValuesOfUnsupportedFieldsAreAccepted) {
  ApiRequest r;
  const auto error = Parse(R"({"messages": [{"role": "user", "content": "a"}],
      "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": false,
      "top_logprobs": 0, "echo": false, "suffix": "", "logit_bias": {},
      "response_format": {"type": "text"}, "tools": [], "functions": [], "tool_choice": "none",
      "function_call": "auto", "parallel_tool_calls": false, "modalities": ["text"],
      "store": false, "audio": null, "reasoning_effort": null, "min_p": 0,
      "repetition_penalty": 1, "user": "u-1", "service_tier": "auto", "metadata": {"k": "v"}})",
                           Endpoint::kChatCompletions, &r);
  EXPECT_FALSE(error.has_value()) << error->message;
  EXPECT_FALSE(Parse(R"({"prompt": "a", "logprobs": 0, "echo": 0, "tool_choice": "auto"})",
                     Endpoint::kCompletions, &r));
  // Metadata is accepted only in its documented type.
  EXPECT_EQ(Fails(R"({"prompt": "a", "user": 5})").param, "user");
  EXPECT_EQ(Fails(R"({"prompt": "a", "metadata": "x"})").param, "metadata");
}

TEST(ApiRequestTest, SeedMustBeAnInteger) {
  ApiRequest r;
  ASSERT_FALSE(Parse(R"({"prompt": "a", "seed": -7})", Endpoint::kCompletions, &r));
  EXPECT_EQ(r.sampling.seed, static_cast<uint64_t>(-7));
  for (const char* seed : {R"("42")", "1.5", "true", "[1]", "18446744073709551615"}) {
    const ApiError e = Fails(std::string(R"({"prompt": "a", "seed": )") + seed + "}");
    EXPECT_EQ(e.param, "seed") << seed;
  }
}

TEST(ApiRequestTest, ToolTurnsAndNonTextPartsAreRefused) {
  struct Case {
    const char* messages;
    const char* param;
    const char* code;
  } cases[] = {
      {R"([{"role": "tool", "content": "42", "tool_call_id": "c"}])", "messages[0].role",
       "unsupported"},
      {R"([{"role": "user", "content": "a"}, {"role": "function", "content": "x"}])",
       "messages[1].role", "unsupported"},
      {R"([{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}])",
       "messages[0].tool_calls", "unsupported"},
      {R"([{"role": "user", "content": "a", "name": "alice"}])", "messages[0].name", "unsupported"},
      {R"([{"role": "user", "content": [{"type": "text", "text": "a"},
           {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])",
       "messages[0].content[1]", "unsupported"},
      {R"([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])",
       "messages[0].content[0]", "unsupported"},
      {R"([{"role": "user", "content": [{"type": "text"}]}])", "messages[0].content[0]",
       "invalid_type"},
      {R"([{"role": "user", "content": ["a"]}])", "messages[0].content[0]", "invalid_type"},
  };
  for (const Case& c : cases) {
    const std::string body = std::string(R"({"messages": )") + c.messages + "}";
    const ApiError e = Fails(body, Endpoint::kChatCompletions);
    EXPECT_EQ(e.param, c.param) << body;
    EXPECT_EQ(e.code, c.code) << body;
  }
  EXPECT_NE(Fails(R"({"messages": [{"role": "tool", "content": "x"}]})", Endpoint::kChatCompletions)
                .message.find("role 'tool' is not supported"),
            std::string::npos);
}

// The token-id workload of bench/serve_bench.py (--prompt-ids): a long array of ids with
// ignore_eos, every id kept as sent; a stray non-id refuses the whole prompt.
TEST(ApiRequestTest, TokenIdPromptWithIgnoreEos) {
  std::string ids;
  std::vector<int32_t> expected;
  for (int32_t i = 0; i < 4096; ++i) {
    const int32_t id = (i * 7919) % 128256;
    if (i > 0) ids += ',';
    ids += std::to_string(id);
    expected.push_back(id);
  }
  ids += ",2147483647";
  expected.push_back(2147483647);
  ApiRequest r;
  ASSERT_FALSE(Parse(R"({"prompt": [)" + ids + R"(], "ignore_eos": true, "max_tokens": 8})",
                     Endpoint::kCompletions, &r));
  EXPECT_EQ(r.prompt_tokens, expected);
  EXPECT_TRUE(r.prompt.empty());
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(*r.max_tokens, 8);
  for (const char* bad : {"[1, -1]", "[1, 2.5]", "[1, \"a\"]", "[1, [2]]", "[2147483648]"}) {
    const ApiError e = Fails(std::string(R"({"prompt": )") + bad + R"(, "ignore_eos": true})",
                             Endpoint::kCompletions);
    EXPECT_EQ(e.param, "prompt") << bad;
  }
}

TEST(ApiRequestTest, ErrorBodyHasOpenAiShape) {
  const nlohmann::json body =
      ErrorBody(ApiError{429, "full", "rate_limit_error", "", "queue_full"});
  EXPECT_EQ(body["error"]["message"], "full");
  EXPECT_EQ(body["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(body["error"]["code"], "queue_full");
}

}  // namespace
}  // namespace shadowkv::server

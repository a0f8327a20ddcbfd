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

// RequestParser: framing, limits and refusals, with every request also fed one byte at a time.
#include "server/http/request_parser.h"

#include <gtest/gtest.h>

#include <string>

namespace shadowkv::server::http {
namespace {

RequestLimits Limits(size_t head = 1024, size_t body = 64) {
  RequestLimits limits;
  limits.max_head_bytes = head;
  limits.max_headers = 8;
  limits.max_body_bytes = body;
  return limits;
}

// Feeds `bytes` whole and, in a second parser, one byte at a time; both must agree. Returns the
// whole-feed parser and sets *used to the bytes it consumed.
RequestParser Parse(const std::string& bytes, size_t* used = nullptr,
                    RequestLimits limits = Limits()) {
  RequestParser whole(limits);
  const size_t consumed = whole.Feed(bytes);
  RequestParser bytewise(limits);
  size_t pos = 0;
  while (pos < bytes.size() && bytewise.state() != RequestParser::State::kComplete &&
         bytewise.state() != RequestParser::State::kError) {
    pos += bytewise.Feed(std::string_view(bytes).substr(pos, 1));
  }
  const std::string shown = bytes.substr(0, 80);
  EXPECT_EQ(whole.state(), bytewise.state()) << shown;
  // What a refused request consumed does not matter: the connection closes.
  if (whole.state() != RequestParser::State::kError) {
    EXPECT_EQ(consumed, pos) << shown;
  }
  EXPECT_EQ(whole.request().body, bytewise.request().body);
  EXPECT_EQ(whole.error().status, bytewise.error().status);
  if (used) *used = consumed;
  return whole;
}

void ExpectRefused(const std::string& bytes, int status, RequestLimits limits = Limits()) {
  RequestParser p = Parse(bytes, nullptr, limits);
  ASSERT_EQ(p.state(), RequestParser::State::kError) << bytes.substr(0, 80);
  EXPECT_EQ(p.error().status, status) << bytes.substr(0, 80) << ": " << p.error().message;
  EXPECT_FALSE(p.error().message.empty());
  EXPECT_FALSE(p.error().code.empty());
}

TEST(RequestParserTest, ContentLengthBodyAndHeaders) {
  const std::string bytes =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Thing:  spaced \r\n"
      "Content-Length: 5\r\n\r\nhello";
  size_t used = 0;
  RequestParser p = Parse(bytes + "GET", &used);
  ASSERT_EQ(p.state(), RequestParser::State::kComplete);
  const Request& r = p.request();
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.path, "/v1/completions");
  EXPECT_EQ(r.target, "/v1/completions?x=1");
  EXPECT_EQ(r.body, "hello");
  ASSERT_NE(r.Header("x-thing"), nullptr);
  EXPECT_EQ(*r.Header("x-thing"), "spaced");
  EXPECT_TRUE(r.keep_alive);
  EXPECT_EQ(used, bytes.size());
}

TEST(RequestParserTest, StopsAtTheEndOfARequestSoPipelinedBytesRemain) {
  const std::string first = "GET /health HTTP/1.1\r\n\r\n";
  const std::string second = "GET /metrics HTTP/1.1\r\n\r\n";
  size_t used = 0;
  RequestParser p = Parse(first + second, &used);
  ASSERT_EQ(p.state(), RequestParser::State::kComplete);
  EXPECT_EQ(p.request().path, "/health");
  EXPECT_EQ(used, first.size());
  p.Reset();
  EXPECT_EQ(p.Feed(std::string_view(first + second).substr(used)), second.size());
  EXPECT_EQ(p.request().path, "/metrics");
}

TEST(RequestParserTest, ChunkedBodyIsDecoded) {
  RequestParser p = Parse(
      "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
      "5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\nTrailer: x\r\n\r\n");
  ASSERT_EQ(p.state(), RequestParser::State::kComplete);
  EXPECT_EQ(p.request().body, "hello!");
}

TEST(RequestParserTest, ChunkedBodyPastTheLimitIsRefusedAtTheChunkSize) {
  // Chunks of 40 bytes, 64 allowed: the second chunk-size line already overflows, before its
  // data arrives.
  const std::string chunk = "28\r\n" + std::string(40, 'a') + "\r\n";
  RequestParser p(Limits());
  p.Feed("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk + "28\r\n");
  ASSERT_EQ(p.state(), RequestParser::State::kError);
  EXPECT_EQ(p.error().status, 413);
  EXPECT_EQ(p.error().code, "body_too_large");
  EXPECT_LE(p.request().body.size(), 64u);
  ExpectRefused("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffffff\r\n",
                413);
}

TEST(RequestParserTest, ContentLengthPastTheLimitIsRefusedWithTheHead) {
  RequestParser p(Limits());
  p.Feed("POST / HTTP/1.1\r\nContent-Length: 65\r\n\r\n");
  ASSERT_EQ(p.state(), RequestParser::State::kError);
  EXPECT_EQ(p.error().status, 413);
  EXPECT_TRUE(p.request().body.empty());
}

TEST(RequestParserTest, InvalidContentLengthsAre400) {
  for (const char* value : {"-5", "", "abc", "5, 5", "+5", "1e3", "99999999999999999999"}) {
    ExpectRefused(std::string("POST / HTTP/1.1\r\nContent-Length: ") + value + "\r\n\r\n", 400);
  }
  ExpectRefused("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400);
  ExpectRefused(
      "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
      400);
}

TEST(RequestParserTest, OversizedHeadIs431) {
  ExpectRefused("GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n", 431);
  std::string many = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 9; ++i) many += "H" + std::to_string(i) + ": v\r\n";
  ExpectRefused(many + "\r\n", 431);
  // No line end at all: refused once the limit is passed, not when the line ends.
  RequestParser p(Limits());
  p.Feed("GET /" + std::string(1100, 'a'));
  EXPECT_EQ(p.state(), RequestParser::State::kError);
  EXPECT_EQ(p.error().status, 431);
}

TEST(RequestParserTest, MalformedHeadsAre400) {
  for (const char* bytes :
       {"GET\r\n\r\n", "GET / HTTP/1.1 extra\r\n\r\n", "GET  / HTTP/1.1\r\n\r\n",
        "GET / FTP/1.1\r\n\r\n", "GET nopath HTTP/1.1\r\n\r\n", "GET / HTTP/1.1\r\n folded\r\n\r\n",
        "GET / HTTP/1.1\r\nBad Name: v\r\n\r\n", "GET / HTTP/1.1\r\nNoColon\r\n\r\n",
        "GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", "G(T / HTTP/1.1\r\n\r\n"}) {
    ExpectRefused(bytes, 400);
  }
  ExpectRefused(std::string("\x00\x01garbage\r\n\r\n", 13), 400);
  ExpectRefused("GET / HTTP/2.0\r\n\r\n", 505);
  ExpectRefused("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501);
  ExpectRefused("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400);
  ExpectRefused("POST / HTTP/1.1\r\nExpect: magic\r\nContent-Length: 1\r\n\r\n", 417);
}

TEST(RequestParserTest, BadChunkFramingIs400) {
  const std::string head = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
  ExpectRefused(head + "zz\r\n", 400);
  ExpectRefused(head + "3\r\nabcdef\r\n", 400);
  ExpectRefused(head + std::string(5000, '0'), 400);
  ExpectRefused(head + "0\r\nno colon here\r\n\r\n", 400);
}

TEST(RequestParserTest, KeepAliveRulesByVersion) {
  EXPECT_FALSE(Parse("GET / HTTP/1.0\r\n\r\n").request().keep_alive);
  EXPECT_TRUE(Parse("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").request().keep_alive);
  EXPECT_FALSE(Parse("GET / HTTP/1.1\r\nConnection: x, close\r\n\r\n").request().keep_alive);
  EXPECT_EQ(Parse("GET / HTTP/1.0\r\n\r\n").request().minor_version, 0);
}

TEST(RequestParserTest, BlankLinesBeforeARequestAreSkippedAndBareLineFeedsAccepted) {
  RequestParser p = Parse("\r\n\r\nGET /a HTTP/1.1\nHost: x\n\n");
  ASSERT_EQ(p.state(), RequestParser::State::kComplete);
  EXPECT_EQ(p.request().path, "/a");
  RequestParser blank(Limits());
  blank.Feed("\r\n\r\n");
  EXPECT_FALSE(blank.started());
  EXPECT_EQ(blank.state(), RequestParser::State::kHead);
}

TEST(RequestParserTest, ExpectContinueOnlyWithABody) {
  EXPECT_TRUE(Parse("POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nab")
                  .request()
                  .expect_continue);
  EXPECT_FALSE(Parse("POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n").request().expect_continue);
}

TEST(RequestParserTest, AbsoluteFormTargetsNameTheirPath) {
  EXPECT_EQ(Parse("GET http://example/health?x HTTP/1.1\r\n\r\n").request().path, "/health");
  EXPECT_EQ(Parse("GET http://example HTTP/1.1\r\n\r\n").request().path, "/");
}

}  // namespace
}  // namespace shadowkv::server::http

// RequestParser: an incremental HTTP/1.x request parser over raw bytes, with size limits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shadowkv::server::http {

struct RequestLimits {
  size_t max_head_bytes = 32 * 1024;  // request line, headers and chunked trailers: 431
  size_t max_headers = 100;           // header fields: 431
  size_t max_body_bytes = 1 << 20;    // decoded body, whatever the framing: 413
};

struct Request {
  std::string method;
  std::string target;  // as sent: path and query
  std::string path;    // the target up to '?'
  int minor_version = 1;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  bool keep_alive = true;        // HTTP/1.1 unless "close"; HTTP/1.0 only with "keep-alive"
  bool expect_continue = false;  // "Expect: 100-continue" with a body to come

  // The first header of that (lower-case) name; nullptr when absent.
  const std::string* Header(std::string_view name) const;
};

// Why a request was refused: the status to answer and a message naming the problem.
struct ParseError {
  int status = 400;
  std::string code;  // the OpenAI-style error code
  std::string message;
};

// Feed() takes bytes as they arrive, in pieces of any size. Once a request is complete it stops
// consuming: the bytes after it (a pipelined request) are left to the caller, who Reset()s and
// feeds them next. Limits are checked as bytes arrive: an oversized head or body is refused
// before it has been buffered whole.
class RequestParser {
 public:
  enum class State { kHead, kBody, kComplete, kError };

  explicit RequestParser(RequestLimits limits) : limits_(limits) {}

  // Consumes a prefix of `data` and returns its length (all of it unless the request completed
  // or failed within it).
  size_t Feed(std::string_view data);
  void Reset();

  State state() const { return state_; }
  // True once any byte of the request (not only blank lines between requests) has arrived.
  bool started() const { return started_; }
  bool head_complete() const { return state_ == State::kBody || state_ == State::kComplete; }
  const Request& request() const { return request_; }
  Request& request() { return request_; }
  const ParseError& error() const { return error_; }

 private:
  enum class BodyStep { kNone, kFixed, kChunkSize, kChunkData, kChunkDataEnd, kTrailer };

  void Fail(int status, std::string code, std::string message);
  // A whole line of the head (without its line end); false once failed.
  bool HeadLine(std::string_view line);
  bool RequestLine(std::string_view line);
  bool HeaderLine(std::string_view line);
  bool EndOfHead();
  bool ChunkSizeLine(std::string_view line);
  // Appends to line_ up to a line end; returns the bytes used and sets *done at the line end.
  size_t TakeLine(std::string_view data, size_t max_line, bool* done, bool* too_long);
  bool AddBody(std::string_view bytes);

  RequestLimits limits_;
  State state_ = State::kHead;
  BodyStep body_step_ = BodyStep::kNone;
  Request request_;
  ParseError error_;
  std::string line_;
  bool started_ = false;
  bool request_line_done_ = false;
  size_t head_bytes_ = 0;
  uint64_t remaining_ = 0;  // of the fixed body or of the current chunk
};

}  // namespace shadowkv::server::http

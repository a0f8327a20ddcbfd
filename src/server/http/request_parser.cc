// RequestParser: request line, header fields, Content-Length and chunked bodies, under limits.
#include "server/http/request_parser.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace shadowkv::server::http {

namespace {

constexpr size_t kMaxChunkLine = 4096;  // a chunk size with its extensions

bool IsTokenChar(unsigned char c) {
  if (c >= '0' && c <= '9') return true;
  if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) != std::string_view::npos;
}

bool IsToken(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return IsTokenChar(c); });
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The comma-separated elements of a header value, trimmed and lower-cased; empty ones dropped.
std::vector<std::string> ListElements(std::string_view value) {
  std::vector<std::string> out;
  while (true) {
    const size_t comma = value.find(',');
    std::string_view element = Trim(value.substr(0, comma));
    if (!element.empty()) out.push_back(Lower(element));
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return out;
}

// Visible ASCII, spaces, tabs and bytes past ASCII (opaque UTF-8); no other control bytes.
bool IsFieldValue(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c == '\t' || (c >= 0x20 && c != 0x7f);
  });
}

}  // namespace

const std::string* Request::Header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

void RequestParser::Reset() {
  state_ = State::kHead;
  body_step_ = BodyStep::kNone;
  request_ = Request();
  error_ = ParseError();
  line_.clear();
  started_ = false;
  request_line_done_ = false;
  head_bytes_ = 0;
  remaining_ = 0;
}

void RequestParser::Fail(int status, std::string code, std::string message) {
  state_ = State::kError;
  error_ = ParseError{status, std::move(code), std::move(message)};
}

size_t RequestParser::TakeLine(std::string_view data, size_t max_line, bool* done, bool* too_long) {
  const size_t newline = data.find('\n');
  const size_t take = newline == std::string_view::npos ? data.size() : newline + 1;
  if (line_.size() + take > max_line) {
    *too_long = true;
    return 0;
  }
  line_.append(data.data(), newline == std::string_view::npos ? take : newline);
  *done = newline != std::string_view::npos;
  if (*done && !line_.empty() && line_.back() == '\r') line_.pop_back();
  return take;
}

size_t RequestParser::Feed(std::string_view data) {
  size_t pos = 0;
  while (pos < data.size() && (state_ == State::kHead || state_ == State::kBody)) {
    std::string_view rest = data.substr(pos);
    const bool fixed = body_step_ == BodyStep::kFixed || body_step_ == BodyStep::kChunkData;
    if (state_ == State::kBody && fixed) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(remaining_, rest.size()));
      request_.body.append(rest.data(), take);
      remaining_ -= take;
      pos += take;
      if (remaining_ == 0) {
        if (body_step_ == BodyStep::kFixed) {
          state_ = State::kComplete;
        } else {
          body_step_ = BodyStep::kChunkDataEnd;
        }
      }
      continue;
    }
    if (state_ == State::kHead && !started_) {
      // Blank lines before a request line are skipped (they count against the head limit).
      if (rest[0] == '\r' || rest[0] == '\n') {
        ++pos;
        if (++head_bytes_ > limits_.max_head_bytes) {
          Fail(431, "header_too_large",
               fmt::format("the request head is larger than {} bytes", limits_.max_head_bytes));
        }
        continue;
      }
      started_ = true;
    }
    // Every other step reads a line: the head's and the trailers' share the head limit.
    const bool in_head = state_ == State::kHead || body_step_ == BodyStep::kTrailer;
    const size_t max_line = in_head ? limits_.max_head_bytes - head_bytes_ : kMaxChunkLine;
    bool done = false;
    bool too_long = false;
    pos += TakeLine(rest, max_line, &done, &too_long);
    if (too_long) {
      if (in_head) {
        Fail(431, "header_too_large",
             fmt::format("the request head is larger than {} bytes", limits_.max_head_bytes));
      } else {
        Fail(400, "invalid_chunked_body", "a chunk-size line is too long");
      }
      break;
    }
    if (!done) break;
    if (in_head) head_bytes_ += line_.size() + 1;
    const std::string line = std::move(line_);
    line_.clear();
    if (state_ == State::kHead) {
      HeadLine(line);
    } else if (body_step_ == BodyStep::kChunkSize) {
      ChunkSizeLine(line);
    } else if (body_step_ == BodyStep::kChunkDataEnd) {
      if (!line.empty()) {
        Fail(400, "invalid_chunked_body", "chunk data is longer than its announced size");
      } else {
        body_step_ = BodyStep::kChunkSize;
      }
    } else if (line.empty()) {  // the end of the trailers
      state_ = State::kComplete;
    } else if (line.find(':') == std::string::npos || !IsFieldValue(line)) {
      Fail(400, "invalid_chunked_body", "a malformed trailer field after the last chunk");
    }
  }
  return pos;
}

bool RequestParser::HeadLine(std::string_view line) {
  if (!request_line_done_) {
    request_line_done_ = true;
    return RequestLine(line);
  }
  if (line.empty()) return EndOfHead();
  return HeaderLine(line);
}

bool RequestParser::RequestLine(std::string_view line) {
  const size_t first = line.find(' ');
  const size_t second = first == std::string_view::npos ? first : line.find(' ', first + 1);
  if (second == std::string_view::npos || line.find(' ', second + 1) != std::string_view::npos) {
    Fail(400, "invalid_request_line",
         "the request line must be 'METHOD target HTTP/1.x', with single spaces");
    return false;
  }
  const std::string_view method = line.substr(0, first);
  std::string_view target = line.substr(first + 1, second - first - 1);
  const std::string_view version = line.substr(second + 1);
  if (!IsToken(method)) {
    Fail(400, "invalid_request_line", "the request method is not a token");
    return false;
  }
  const bool target_ok = !target.empty() && std::all_of(target.begin(), target.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c > 0x20 && c != 0x7f;
  });
  if (!target_ok) {
    Fail(400, "invalid_request_line", "the request target is empty or has control bytes");
    return false;
  }
  if (version.size() == 8 && version.substr(0, 5) == "HTTP/" && version[6] == '.' &&
      version[5] >= '0' && version[5] <= '9' && version[7] >= '0' && version[7] <= '9') {
    if (version[5] != '1') {
      Fail(505, "unsupported_http_version",
           fmt::format("{} is not supported; use HTTP/1.1 or HTTP/1.0", version));
      return false;
    }
    request_.minor_version = version[7] - '0';
  } else {
    Fail(400, "invalid_request_line", "the request line does not end with an HTTP version");
    return false;
  }
  request_.method = std::string(method);
  request_.target = std::string(target);
  // The absolute form (a proxy's) names the same resource as its path.
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.substr(0, scheme.size()) == scheme) {
      const size_t slash = target.find('/', scheme.size());
      target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
    }
  }
  if (target[0] != '/' && target != "*") {
    Fail(400, "invalid_request_line", "the request target must be a path starting with '/'");
    return false;
  }
  request_.path = std::string(target.substr(0, target.find('?')));
  request_.keep_alive = request_.minor_version >= 1;
  return true;
}

bool RequestParser::HeaderLine(std::string_view line) {
  if (line[0] == ' ' || line[0] == '\t') {
    Fail(400, "invalid_header", "obsolete header line folding is not accepted");
    return false;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos || !IsToken(line.substr(0, colon))) {
    Fail(400, "invalid_header", "a header line is not 'name: value' with a token name");
    return false;
  }
  const std::string_view value = Trim(line.substr(colon + 1));
  if (!IsFieldValue(value)) {
    Fail(400, "invalid_header",
         fmt::format("header {} has control bytes in its value", line.substr(0, colon)));
    return false;
  }
  if (request_.headers.size() >= limits_.max_headers) {
    Fail(431, "header_too_large",
         fmt::format("the request has more than {} header fields", limits_.max_headers));
    return false;
  }
  request_.headers.emplace_back(Lower(line.substr(0, colon)), std::string(value));
  return true;
}

bool RequestParser::EndOfHead() {
  std::optional<uint64_t> content_length;
  std::vector<std::string> codings;
  for (const auto& [name, value] : request_.headers) {
    if (name == "content-length") {
      uint64_t n = 0;
      bool ok = !value.empty() && value.size() <= 18;
      for (char c : value) ok = ok && c >= '0' && c <= '9';
      if (ok) {
        for (char c : value) n = n * 10 + static_cast<uint64_t>(c - '0');
      }
      if (!ok || (content_length && *content_length != n)) {
        Fail(400, "invalid_content_length",
             fmt::format("Content-Length '{}' is not one non-negative decimal integer", value));
        return false;
      }
      content_length = n;
    } else if (name == "transfer-encoding") {
      for (std::string& coding : ListElements(value)) codings.push_back(std::move(coding));
    } else if (name == "connection") {
      for (const std::string& option : ListElements(value)) {
        if (option == "close") request_.keep_alive = false;
        if (option == "keep-alive" && request_.minor_version == 0) request_.keep_alive = true;
      }
    } else if (name == "expect") {
      if (Lower(value) != "100-continue") {
        Fail(417, "expectation_failed",
             fmt::format("Expect: '{}' is not supported (only 100-continue)", value));
        return false;
      }
      request_.expect_continue = true;
    }
  }
  // Each refusal below closes a way to disagree with a proxy about where the body ends.
  const bool has_te = request_.Header("transfer-encoding") != nullptr;
  if (has_te && request_.minor_version == 0) {
    Fail(400, "invalid_transfer_encoding", "Transfer-Encoding is not allowed in HTTP/1.0");
    return false;
  }
  if (has_te && content_length) {
    Fail(400, "invalid_transfer_encoding",
         "a request must not carry both Transfer-Encoding and Content-Length");
    return false;
  }
  if (has_te) {
    for (const std::string& coding : codings) {
      if (coding != "chunked") {
        Fail(501, "unsupported_transfer_encoding",
             fmt::format("transfer coding '{}' is not supported (only chunked)", coding));
        return false;
      }
    }
    if (codings.size() != 1) {
      Fail(400, "invalid_transfer_encoding", "Transfer-Encoding must name chunked exactly once");
      return false;
    }
    state_ = State::kBody;
    body_step_ = BodyStep::kChunkSize;
    return true;
  }
  const uint64_t length = content_length.value_or(0);
  if (length > limits_.max_body_bytes) {
    Fail(413, "body_too_large",
         fmt::format("the request body ({} bytes) is larger than {} bytes", length,
                     limits_.max_body_bytes));
    return false;
  }
  if (length == 0) {
    request_.expect_continue = false;
    state_ = State::kComplete;
    return true;
  }
  request_.body.reserve(static_cast<size_t>(length));
  remaining_ = length;
  state_ = State::kBody;
  body_step_ = BodyStep::kFixed;
  return true;
}

bool RequestParser::ChunkSizeLine(std::string_view line) {
  line = Trim(line.substr(0, line.find(';')));  // chunk extensions carry nothing we use
  uint64_t size = 0;
  bool ok = !line.empty();
  for (char c : line) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') digit = (c | 0x20) - 'a' + 10;
    if (digit < 0) {
      ok = false;
      break;
    }
    // Past the body limit already: no need to read further digits (or to overflow).
    if (size > limits_.max_body_bytes) continue;
    size = size * 16 + static_cast<uint64_t>(digit);
  }
  if (!ok) {
    Fail(400, "invalid_chunked_body",
         fmt::format("chunk size '{}' is not a hexadecimal number", line.substr(0, 40)));
    return false;
  }
  if (size > limits_.max_body_bytes - request_.body.size()) {
    Fail(413, "body_too_large",
         fmt::format("the decoded request body is larger than {} bytes", limits_.max_body_bytes));
    return false;
  }
  if (size == 0) {
    body_step_ = BodyStep::kTrailer;
    return true;
  }
  remaining_ = size;
  body_step_ = BodyStep::kChunkData;
  return true;
}

}  // namespace shadowkv::server::http

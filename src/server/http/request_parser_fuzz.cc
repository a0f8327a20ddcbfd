// libFuzzer target: RequestParser over arbitrary bytes, fed whole and in pieces, must agree with
// itself and keep to its limits.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/http/request_parser.h"

using shadowkv::server::http::RequestLimits;
using shadowkv::server::http::RequestParser;

namespace {

// Feeds `data` in pieces of `piece` bytes until the request completes or fails; the bytes used.
size_t FeedInPieces(RequestParser& parser, std::string_view data, size_t piece) {
  size_t pos = 0;
  while (pos < data.size() && (parser.state() == RequestParser::State::kHead ||
                               parser.state() == RequestParser::State::kBody)) {
    const size_t used = parser.Feed(data.substr(pos, piece));
    if (used > piece) std::abort();
    pos += used;
    if (used < std::min(piece, data.size() - pos + used) &&
        (parser.state() == RequestParser::State::kHead ||
         parser.state() == RequestParser::State::kBody)) {
      std::abort();  // stopped consuming without completing or failing
    }
  }
  return pos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 1) return 0;
  const size_t piece = 1 + bytes[0] % 17;  // the first byte picks the piece size
  const std::string_view data(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  RequestLimits limits;
  limits.max_head_bytes = 512;
  limits.max_headers = 16;
  limits.max_body_bytes = 256;
  RequestParser whole(limits);
  const size_t used = whole.Feed(data);
  RequestParser pieces(limits);
  const size_t used_in_pieces = FeedInPieces(pieces, data, piece);
  if (whole.state() != pieces.state()) std::abort();
  if (whole.state() == RequestParser::State::kError) {
    if (whole.error().status != pieces.error().status || whole.error().message.empty()) {
      std::abort();
    }
    return 0;
  }
  if (used != used_in_pieces || used > data.size()) std::abort();
  if (whole.request().body != pieces.request().body) std::abort();
  if (whole.request().body.size() > limits.max_body_bytes) std::abort();
  if (whole.state() == RequestParser::State::kComplete) {
    // What follows a complete request parses as the next one, from a fresh state.
    whole.Reset();
    whole.Feed(data.substr(used));
  }
  return 0;
}

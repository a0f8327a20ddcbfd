// The chat page served at GET /: one self-contained HTML document (no build step, no CDN).
#pragma once

#include <string_view>

namespace shadowkv::server {

// HTML + CSS + JS; the page streams replies from POST /v1/chat/completions and keeps the
// conversation so that each turn extends the previous one (and reuses its KV state).
std::string_view ChatPageHtml();

}  // namespace shadowkv::server

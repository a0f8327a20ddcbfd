// Rendering task prompts and follow-up turns.
#include "eval/prompt_format.h"

#include <vector>

namespace shadowkv::eval {
namespace {

// The answer prefix goes right after the assistant header, where the model writes its answer:
// without RULER's leading space (it followed a plain-text question, not a header).
std::string_view HeaderPrefix(std::string_view prefix) {
  while (!prefix.empty() && prefix.front() == ' ') prefix.remove_prefix(1);
  return prefix;
}

}  // namespace

std::string PromptFormat::First(const PromptParts& parts) const {
  if (!chat_template_) return parts.user + parts.answer_prefix;
  const std::vector<ChatMessage> messages = {{"user", parts.user}};
  return ApplyChatTemplate(*chat_template_, messages, /*add_generation_prompt=*/true) +
         std::string(HeaderPrefix(parts.answer_prefix));
}

std::string PromptFormat::Followup(const PromptParts& parts) const {
  if (!chat_template_) return "\n" + parts.user + parts.answer_prefix;
  // Render an assistant turn holding a marker plus the next user turn; what follows the marker
  // is the markup between the answer and the next answer.
  constexpr std::string_view kMarker = "@@shadowkv-answer@@";
  const std::vector<ChatMessage> messages = {{"assistant", std::string(kMarker)},
                                             {"user", parts.user}};
  const std::string text = ApplyChatTemplate(*chat_template_, messages, true);
  const size_t at = text.find(kMarker);
  return text.substr(at == std::string::npos ? text.size() : at + kMarker.size()) +
         std::string(HeaderPrefix(parts.answer_prefix));
}

std::string PromptFormat::name() const {
  return chat_template_ ? ChatFormatName(chat_template_->format) : "plain";
}

}  // namespace shadowkv::eval

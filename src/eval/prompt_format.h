// How task prompts reach the model: wrapped in its chat template with the answer prefix after
// the assistant header (RULER appends the answer prefix after the model template), or plain.
#pragma once

#include <optional>
#include <string>

#include "eval/tasks.h"
#include "format/chat_template.h"

namespace shadowkv::eval {

class PromptFormat {
 public:
  // Plain text: the user turn directly followed by the answer prefix (RULER's "base").
  static PromptFormat Plain() { return PromptFormat(std::nullopt); }
  static PromptFormat Chat(ChatTemplate chat_template) {
    return PromptFormat(std::move(chat_template));
  }

  // The whole first prompt. Encode with add_special = true, parse_special = true.
  std::string First(const PromptParts& parts) const;
  // What follows an assistant answer to ask the next question in the same conversation: the
  // end of the assistant turn, the user turn, the assistant header and the answer prefix.
  // Encode with add_special = false, parse_special = true.
  std::string Followup(const PromptParts& parts) const;
  std::string name() const;

 private:
  explicit PromptFormat(std::optional<ChatTemplate> chat_template)
      : chat_template_(std::move(chat_template)) {}
  std::optional<ChatTemplate> chat_template_;
};

}  // namespace shadowkv::eval

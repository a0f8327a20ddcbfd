// Chat formats: recognising a model's Jinja template by its markers, and rendering turns.
#include "format/chat_template.h"

#include <algorithm>

#include "format/gguf.h"
#include "format/tokenizer.h"
#include "format/unicode.h"

namespace shadowkv {
namespace {

constexpr std::string_view kSupportedFormats =
    "ChatML (<|im_start|>), Llama 3 (<|start_header_id|>), Gemma (<start_of_turn>), GLM-4 "
    "([gMASK]<sop>), ChatGLM3 ([gMASK]sop)";

// Jinja's `trim`: Python's str.strip(), i.e. White_Space plus the separators U+001C..U+001F.
std::string_view Trim(std::string_view text) {
  const auto is_space_at = [&](size_t offset, uint32_t* num_bytes) {
    const unicode::DecodedCodepoint decoded = unicode::DecodeUtf8(text, offset);
    *num_bytes = decoded.num_bytes;
    return unicode::IsWhitespace(decoded.codepoint) ||
           (decoded.codepoint >= 0x1C && decoded.codepoint <= 0x1F);
  };
  size_t begin = 0;
  uint32_t num_bytes = 0;
  while (begin < text.size() && is_space_at(begin, &num_bytes)) begin += num_bytes;
  size_t end = begin;  // end of the last non-space codepoint seen
  for (size_t offset = begin; offset < text.size(); offset += num_bytes) {
    if (!is_space_at(offset, &num_bytes)) end = offset + num_bytes;
  }
  return text.substr(begin, end - begin);
}

// The literal default system prompt of a ChatML template: a string constant in the template
// that runs "<|im_start|>system", a newline (written as such or as \n), the prompt, then
// "<|im_end|>". Constants that stop before <|im_end|> (the prompt comes from a variable) are
// passed over. Returns "" when there is none.
std::string ExtractDefaultSystemPrompt(std::string_view text) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  constexpr std::string_view kClose = "<|im_end|>";
  for (size_t open = text.find(kOpen); open != std::string_view::npos;
       open = text.find(kOpen, open + 1)) {
    if (open == 0 || (text[open - 1] != '\'' && text[open - 1] != '"')) continue;
    const char quote = text[open - 1];
    size_t pos = open + kOpen.size();
    if (text.substr(pos).starts_with("\n")) {
      pos += 1;
    } else if (text.substr(pos).starts_with("\\n")) {
      pos += 2;
    } else {
      continue;
    }
    std::string prompt;
    bool found = false;
    while (pos < text.size() && text[pos] != quote) {
      if (text.substr(pos).starts_with(kClose)) {
        found = true;
        break;
      }
      if (text[pos] == '\\' && pos + 1 < text.size()) {
        const char escaped = text[pos + 1];
        prompt += escaped == 'n' ? '\n' : escaped == 't' ? '\t' : escaped;
        pos += 2;
      } else {
        prompt += text[pos++];
      }
    }
    if (found && !prompt.empty()) return prompt;
  }
  return "";
}

// Builds the pieces, merging neighbours of the same kind.
class PieceWriter {
 public:
  void Markup(std::string_view text) { Append(text, true); }
  void Content(std::string_view text) { Append(text, false); }
  std::vector<ChatPiece> Take() { return std::move(pieces_); }

 private:
  void Append(std::string_view text, bool markup) {
    if (text.empty()) return;
    if (pieces_.empty() || pieces_.back().markup != markup) pieces_.push_back({"", markup});
    pieces_.back().text += text;
  }
  std::vector<ChatPiece> pieces_;
};

void AppendLlama3Turn(std::string_view role, std::string_view content, PieceWriter& out) {
  out.Markup("<|start_header_id|>");
  out.Markup(role);
  out.Markup("<|end_header_id|>\n\n");
  out.Content(Trim(content));
  out.Markup("<|eot_id|>");
}

}  // namespace

const char* ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kChatML:
      return "chatml";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kLlama31:
      return "llama3.1";
    case ChatFormat::kGemma:
      return "gemma";
    case ChatFormat::kGlm4:
      return "glm4";
    case ChatFormat::kChatGlm3:
      return "chatglm3";
  }
  return "unknown";
}

Result<ChatTemplate> DetectChatTemplate(std::string_view template_text) {
  ChatTemplate chat_template;
  if (template_text.find("<|start_header_id|>") != std::string_view::npos &&
      template_text.find("<|end_header_id|>") != std::string_view::npos) {
    chat_template.format = template_text.find("Cutting Knowledge Date") != std::string_view::npos
                               ? ChatFormat::kLlama31
                               : ChatFormat::kLlama3;
    return chat_template;
  }
  if (template_text.find("<start_of_turn>") != std::string_view::npos) {
    chat_template.format = ChatFormat::kGemma;
    return chat_template;
  }
  if (template_text.find("[gMASK]<sop>") != std::string_view::npos) {
    chat_template.format = ChatFormat::kGlm4;
    return chat_template;
  }
  if (template_text.find("[gMASK]sop") != std::string_view::npos) {
    chat_template.format = ChatFormat::kChatGlm3;
    return chat_template;
  }
  if (template_text.find("<|im_start|>") != std::string_view::npos) {
    chat_template.format = ChatFormat::kChatML;
    chat_template.default_system_prompt = ExtractDefaultSystemPrompt(template_text);
    return chat_template;
  }
  return Error(ErrorCode::kUnsupported, "chat template not recognised; supported: {}",
               kSupportedFormats);
}

Result<ChatTemplate> DetectChatTemplate(const gguf::GgufFile& file) {
  if (file.Find("tokenizer.chat_template") != nullptr) {
    SKV_ASSIGN_OR_RETURN(const std::string text, file.GetString("tokenizer.chat_template"));
    return DetectChatTemplate(text);
  }
  // No template: go by the turn markers the vocabulary has.
  if (file.Find("tokenizer.ggml.tokens") != nullptr) {
    SKV_ASSIGN_OR_RETURN(const std::vector<std::string> tokens,
                         file.GetStringArray("tokenizer.ggml.tokens"));
    const auto has = [&](std::string_view token) {
      return std::find(tokens.begin(), tokens.end(), token) != tokens.end();
    };
    if (has("<|start_header_id|>") && has("<|end_header_id|>")) {
      return ChatTemplate{ChatFormat::kLlama3, ""};
    }
    if (has("<|im_start|>") && has("<|im_end|>")) return ChatTemplate{ChatFormat::kChatML, ""};
    if (has("<start_of_turn>") && has("<end_of_turn>")) return ChatTemplate{ChatFormat::kGemma, ""};
    if (has("[gMASK]") && has("<|user|>") && has("<|assistant|>")) {
      if (has("<sop>")) return ChatTemplate{ChatFormat::kGlm4, ""};
      if (has("sop")) return ChatTemplate{ChatFormat::kChatGlm3, ""};
    }
  }
  std::string architecture = "(none)";
  if (file.Find("general.architecture") != nullptr) {
    SKV_ASSIGN_OR_RETURN(architecture, file.GetString("general.architecture"));
  }
  if (architecture == "qwen2" || architecture == "qwen3") {
    return ChatTemplate{ChatFormat::kChatML, ""};
  }
  if (architecture == "gemma3") return ChatTemplate{ChatFormat::kGemma, ""};
  if (architecture == "glm4" || architecture == "chatglm") {
    return ChatTemplate{ChatFormat::kGlm4, ""};
  }
  return Error(ErrorCode::kUnsupported,
               "no tokenizer.chat_template and no known turn tokens (architecture {}); "
               "supported: {}",
               architecture, kSupportedFormats);
}

Result<ChatFormat> DetectChatFormat(const gguf::GgufFile& file) {
  SKV_ASSIGN_OR_RETURN(const ChatTemplate chat_template, DetectChatTemplate(file));
  return chat_template.format;
}

std::vector<ChatPiece> RenderChat(const ChatTemplate& chat_template,
                                  std::span<const ChatMessage> messages,
                                  bool add_generation_prompt) {
  PieceWriter out;
  switch (chat_template.format) {
    case ChatFormat::kChatML: {
      const auto append_turn = [&](std::string_view role, std::string_view content) {
        out.Markup("<|im_start|>");
        out.Markup(role);
        out.Markup("\n");
        out.Content(content);
        out.Markup("<|im_end|>\n");
      };
      if (!chat_template.default_system_prompt.empty() && !messages.empty() &&
          messages[0].role != "system") {
        append_turn("system", chat_template.default_system_prompt);
      }
      for (const ChatMessage& message : messages) append_turn(message.role, message.content);
      if (add_generation_prompt) out.Markup("<|im_start|>assistant\n");
      break;
    }
    case ChatFormat::kLlama3:
      for (const ChatMessage& message : messages) {
        AppendLlama3Turn(message.role, message.content, out);
      }
      if (add_generation_prompt) out.Markup("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatFormat::kLlama31: {
      // The system turn is always there; a system message's text goes after the dates.
      std::string_view system_prompt;
      if (!messages.empty() && messages[0].role == "system") {
        system_prompt = messages[0].content;
        messages = messages.subspan(1);
      }
      out.Markup("<|start_header_id|>system<|end_header_id|>\n\n");
      out.Markup("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
      out.Content(Trim(system_prompt));
      out.Markup("<|eot_id|>");
      for (const ChatMessage& message : messages) {
        AppendLlama3Turn(message.role, message.content, out);
      }
      if (add_generation_prompt) out.Markup("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    }
    case ChatFormat::kGemma: {
      std::string_view first_prefix;
      if (!messages.empty() && messages[0].role == "system") {
        first_prefix = messages[0].content;
        messages = messages.subspan(1);
      }
      for (size_t i = 0; i < messages.size(); ++i) {
        const std::string& role = messages[i].role;
        out.Markup("<start_of_turn>");
        out.Markup(role == "assistant" ? "model" : role);
        out.Markup("\n");
        if (i == 0 && !first_prefix.empty()) {
          out.Content(first_prefix);
          out.Content("\n\n");
        }
        out.Content(Trim(messages[i].content));
        out.Markup("<end_of_turn>\n");
      }
      if (add_generation_prompt) out.Markup("<start_of_turn>model\n");
      break;
    }
    case ChatFormat::kGlm4:
    case ChatFormat::kChatGlm3: {
      // The two differ in the opening token, a space before each message and the newline
      // after the generation prompt.
      const bool glm4 = chat_template.format == ChatFormat::kGlm4;
      out.Markup(glm4 ? "[gMASK]<sop>" : "[gMASK]sop");
      for (const ChatMessage& message : messages) {
        out.Markup("<|" + message.role + (glm4 ? "|>\n" : "|>\n "));
        out.Content(message.content);
      }
      if (add_generation_prompt) out.Markup(glm4 ? "<|assistant|>\n" : "<|assistant|>");
      break;
    }
  }
  return out.Take();
}

std::vector<int32_t> EncodeChat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                std::span<const ChatMessage> messages, bool add_generation_prompt) {
  const std::vector<ChatPiece> pieces = RenderChat(chat_template, messages, add_generation_prompt);
  std::vector<TextSegment> segments;
  segments.reserve(pieces.size());
  for (const ChatPiece& piece : pieces) segments.push_back({piece.text, piece.markup});
  return tokenizer.Encode(segments, /*add_special=*/true);
}

std::string ApplyChatTemplate(const ChatTemplate& chat_template,
                              std::span<const ChatMessage> messages, bool add_generation_prompt) {
  std::string out;
  for (const ChatPiece& piece : RenderChat(chat_template, messages, add_generation_prompt)) {
    out += piece.text;
  }
  return out;
}

std::string ApplyChatTemplate(ChatFormat format, std::span<const ChatMessage> messages,
                              bool add_generation_prompt) {
  return ApplyChatTemplate(ChatTemplate{format, ""}, messages, add_generation_prompt);
}

}  // namespace shadowkv

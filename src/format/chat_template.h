// Chat prompt formats (ChatML, Llama 3, Gemma, GLM-4, ChatGLM3): detection from GGUF metadata
// and rendering.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace shadowkv {

namespace gguf {
class GgufFile;
}
class Tokenizer;

enum class ChatFormat {
  // <|im_start|>{role}\n{content}<|im_end|>\n ... then <|im_start|>assistant\n
  kChatML,
  // <|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|> ... then
  // <|start_header_id|>assistant<|end_header_id|>\n\n
  kLlama3,
  // Llama 3.1+: as kLlama3, but a system turn always comes first and opens with
  // "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" (the template's
  // fallback date).
  kLlama31,
  // <start_of_turn>{user|model}\n{content, trimmed}<end_of_turn>\n ... then
  // <start_of_turn>model\n. A system message has no turn of its own: its text and a blank line
  // open the first turn after it (Gemma 3's template).
  kGemma,
  // [gMASK]<sop> once, then <|{role}|>\n{content} per message ... then <|assistant|>\n
  // (GLM-4-9B-chat and GLM-4-0414: the chatglm and glm4 architectures). A turn ends where the
  // next opens; the model ends its own with <|user|>, the file's end-of-turn token.
  kGlm4,
  // [gMASK]sop once, then <|{role}|>\n {content} per message (a space before the content) ...
  // then <|assistant|> (ChatGLM3-6B: the chatglm architecture with the SentencePiece "sop").
  kChatGlm3,
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ... (written verbatim)
  std::string content;
};

// A format plus what the model's template adds on its own.
struct ChatTemplate {
  ChatFormat format = ChatFormat::kChatML;
  // Inserted as a system turn when the first message is not one (SmolLM2: "You are a helpful
  // AI assistant named SmolLM, trained by Hugging Face"; Qwen2.5: "You are Qwen, created by
  // Alibaba Cloud. You are a helpful assistant."). Empty: none. kChatML only.
  std::string default_system_prompt;
};

const char* ChatFormatName(ChatFormat format);

// From the Jinja source of a chat template (GGUF tokenizer.chat_template). Unrecognised
// templates are kUnsupported, naming the supported formats.
Result<ChatTemplate> DetectChatTemplate(std::string_view template_text);
// From a model file: its tokenizer.chat_template, or where that is absent, the turn tokens
// its vocabulary has and its architecture.
Result<ChatTemplate> DetectChatTemplate(const gguf::GgufFile& file);
Result<ChatFormat> DetectChatFormat(const gguf::GgufFile& file);

// One stretch of a rendered chat prompt: the template's own markup, whose special-token texts
// stand for those tokens, or a message's content, which is only ever text.
struct ChatPiece {
  std::string text;
  bool markup = false;
};

// The prompt for `messages` as markup and content pieces in order, ending with the assistant
// header when `add_generation_prompt`. It holds no BOS.
std::vector<ChatPiece> RenderChat(const ChatTemplate& chat_template,
                                  std::span<const ChatMessage> messages,
                                  bool add_generation_prompt);

// The prompt's token ids, with BOS where the model wants one. Special tokens come only from the
// template: "<|im_end|>" or "<|eot_id|>" written in a message is encoded as the characters, so
// content cannot close its turn or open another.
std::vector<int32_t> EncodeChat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                std::span<const ChatMessage> messages, bool add_generation_prompt);

// RenderChat's pieces joined: for display and for comparing with a reference rendering. Encoding
// this text with parse_special = true would let content forge turns; encode with EncodeChat.
std::string ApplyChatTemplate(const ChatTemplate& chat_template,
                              std::span<const ChatMessage> messages, bool add_generation_prompt);
std::string ApplyChatTemplate(ChatFormat format, std::span<const ChatMessage> messages,
                              bool add_generation_prompt);

}  // namespace shadowkv

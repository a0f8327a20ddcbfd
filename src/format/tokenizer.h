// Byte-level BPE ("gpt2") and SentencePiece ("llama") tokenizers of GGUF files, and a streaming
// detokenizer.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/status.h"
#include "format/pre_tokenizer.h"

namespace shadowkv {

namespace gguf {
class GgufFile;
}

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // e.g. <|im_start|>: matched in text only when asked to parse specials
  kUserDefined = 4,  // added tokens, as plain (not byte-mapped) text; see Encode for matching
  kUnused = 5,
  kByte = 6,
};

// A stretch of text to encode and whether special-token texts in it may become those tokens.
struct TextSegment {
  std::string_view text;
  bool parse_special = false;
};

// GPT-2's byte-to-unicode form of `bytes`, as byte-level vocabularies store token texts.
std::string ByteLevelText(std::string_view bytes);

// Everything a tokenizer is built from; FromGguf fills it from metadata, tests by hand.
struct TokenizerConfig {
  std::vector<std::string> tokens;     // token texts in GPT-2 byte-to-unicode form
  std::vector<TokenType> token_types;  // empty: all normal
  std::vector<std::string> merges;     // "left right", highest priority first
  std::string pre;                     // tokenizer.ggml.pre
  int32_t bos_id = -1;                 // -1: none
  int32_t eos_id = -1;
  int32_t eot_id = -1;
  int32_t eom_id = -1;
  int32_t padding_id = -1;
  bool add_bos = false;
  bool add_eos = false;
  // SentencePiece (tokenizer.ggml.model "llama"): token texts spell spaces as U+2581 and bytes
  // as <0xAB> tokens; merges go by `scores` (one per token), not by a merge list.
  bool sentencepiece = false;
  std::vector<float> scores;
  bool add_space_prefix = false;  // a space before the text at the start and after specials
};

// Immutable after construction; safe to use from several threads.
class Tokenizer {
 public:
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Reads tokenizer.ggml.* metadata. An unsupported model or pre-tokenizer is kUnsupported (the
  // message lists the supported ones); inconsistent metadata is kCorrupt.
  static Result<std::unique_ptr<Tokenizer>> FromGguf(const gguf::GgufFile& file);
  static Result<std::unique_ptr<Tokenizer>> Create(TokenizerConfig config);

  // `add_special`: BOS/EOS as the model's add_bos/add_eos say. `parse_special`: control-token
  // texts such as "<|im_start|>" in `text` become those tokens. Without it, only user-defined
  // tokens that carry no structure are matched: never a control token, BOS/EOS, an end-of-turn
  // token or a turn marker, even where the vocabulary marks one as user-defined.
  std::vector<int32_t> Encode(std::string_view text, bool add_special, bool parse_special) const;
  // As the concatenation of the segments' texts, with special tokens matched in each segment as
  // its parse_special says (a token never spans two segments). The text between special tokens is
  // pre-tokenized as a whole across segment boundaries, so the ids equal those of the
  // concatenation whenever no special-token text is refused.
  std::vector<int32_t> Encode(std::span<const TextSegment> segments, bool add_special) const;

  // Concatenated bytes of the tokens (not necessarily valid UTF-8 when cut mid-character).
  // `skip_special` drops control tokens. Ids outside the vocabulary produce nothing.
  std::string Decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The token as stored in the vocabulary (e.g. "Ġthe"); empty for ids out of range.
  const std::string& TokenText(int32_t id) const;
  // The bytes the token stands for (e.g. " the").
  std::string_view TokenBytes(int32_t id) const;
  TokenType GetTokenType(int32_t id) const;
  // Id of a token by its vocabulary text, or -1.
  int32_t FindToken(std::string_view text) const;

  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t eot_id() const { return eot_id_; }
  int32_t padding_id() const { return padding_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  PreTokenizerType pre_tokenizer() const { return pre_type_; }

  // Generation stops at EOS, EOT, EOM and the chat end tokens the vocabulary has
  // (<|im_end|>, <|eot_id|>, <|end_of_text|>, <|endoftext|>, ...).
  bool IsEndOfGeneration(int32_t id) const { return end_of_generation_ids_.contains(id); }

 private:
  Tokenizer() = default;
  Status Build(TokenizerConfig config);
  // Appends the BPE encoding of one pre-tokenized piece.
  void EncodePiece(std::string_view piece, std::string& scratch, std::vector<int32_t>& out) const;
  void EncodeText(std::string_view text, std::vector<int32_t>& out) const;
  // SentencePiece: merges the text's characters pairwise, highest-scoring token first.
  void EncodeSentencePiece(std::string_view text, std::vector<int32_t>& out) const;
  // The special token whose text starts text[pos], longest first; -1 if none may match there.
  int32_t MatchSpecial(std::string_view text, size_t pos, bool parse_special) const;

  struct Merge {
    int32_t rank;
    int32_t result_id;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  std::vector<std::string> tokens_;
  std::vector<std::string> token_bytes_;  // decoded form of each token
  std::vector<TokenType> token_types_;
  std::unordered_map<std::string_view, int32_t> token_ids_;  // views into tokens_
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_token_ids_{};  // the single-byte token of each byte, or -1
  // Tokens matched as whole strings in the input, longest first within each first byte.
  std::array<std::vector<int32_t>, 256> special_by_first_byte_;
  // Per token: matched in text even when specials are not parsed (structure-free user-defined).
  std::vector<bool> matched_in_plain_text_;
  std::unordered_set<int32_t> end_of_generation_ids_;
  PreTokenizerType pre_type_ = PreTokenizerType::kGpt2;
  bool ignore_merges_ = false;  // a piece that is itself a token skips the merges (Llama 3)
  bool sentencepiece_ = false;
  bool add_space_prefix_ = false;
  std::vector<float> scores_;  // SentencePiece only
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t eot_id_ = -1;
  int32_t eom_id_ = -1;
  int32_t padding_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
};

// Turns a stream of token ids into text that is always whole, valid UTF-8: bytes of a
// character split across tokens are held until it completes; malformed bytes become U+FFFD.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(tokenizer), skip_special_(skip_special) {}

  // Text completed by this token (possibly empty).
  std::string Push(int32_t id);
  // Whatever is still held, as U+FFFD for each unfinished character; resets the decoder.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_;  // bytes of an unfinished character
};

}  // namespace shadowkv

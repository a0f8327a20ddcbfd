// Tokenizers: special-token split, then byte-level BPE (pre-tokenization, rank-ordered merges
// per piece) or SentencePiece (score-ordered merges of characters, byte fallback).
#include "format/tokenizer.h"

#include <algorithm>
#include <cmath>

#include "format/gguf.h"
#include "format/unicode.h"

namespace shadowkv {
namespace {

// GPT-2's reversible byte-to-unicode map: printable Latin-1 bytes stand for themselves, the
// rest (controls, space, 0x7F-0xA0, 0xAD) take codepoints 256, 257, ... in byte order, so
// every token text is printable and free of spaces.
struct ByteMap {
  std::array<char32_t, 256> byte_to_codepoint{};
  std::array<int16_t, 324> codepoint_to_byte{};  // -1 where no byte maps

  ByteMap() {
    codepoint_to_byte.fill(-1);
    char32_t next_extra = 256;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable =
          (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      const char32_t codepoint = printable ? byte : next_extra++;
      byte_to_codepoint[byte] = codepoint;
      codepoint_to_byte[codepoint] = static_cast<int16_t>(byte);
    }
  }
};

const ByteMap& GetByteMap() {
  static const ByteMap map;
  return map;
}

// The bytes a byte-mapped token text stands for. Codepoints outside the map are kept as
// UTF-8 so that a malformed vocabulary still decodes to something readable.
std::string UnmapBytes(std::string_view text) {
  const ByteMap& map = GetByteMap();
  std::string bytes;
  bytes.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    const unicode::DecodedCodepoint decoded = unicode::DecodeUtf8(text, offset);
    if (decoded.codepoint < map.codepoint_to_byte.size() &&
        map.codepoint_to_byte[decoded.codepoint] >= 0) {
      bytes.push_back(static_cast<char>(map.codepoint_to_byte[decoded.codepoint]));
    } else {
      bytes.append(text.substr(offset, decoded.num_bytes));
    }
    offset += decoded.num_bytes;
  }
  return bytes;
}

void MapBytes(std::string_view bytes, std::string& out) {
  const ByteMap& map = GetByteMap();
  out.clear();
  for (const char byte : bytes) {
    unicode::AppendUtf8(map.byte_to_codepoint[static_cast<uint8_t>(byte)], out);
  }
}

// Token texts that end a turn or a document in the chat formats we know.
constexpr std::string_view kEndOfGenerationTexts[] = {
    "<|eot_id|>",    "<|eom_id|>",      "<|im_end|>",    "<|end|>",
    "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>",
};
// Turn markers of the chat formats we know: plain text never produces them, whatever their type.
constexpr std::string_view kTurnMarkerTexts[] = {
    "<|im_start|>",    "<|start_header_id|>", "<|end_header_id|>",
    "<start_of_turn>", "<|begin_of_text|>",
};
// Preferred end-of-turn token when the metadata names none, in this order (GLM-4 ends its turn
// by opening the user's, as llama.cpp's converter records in eot_token_id).
constexpr std::string_view kEndOfTurnTexts[] = {"<|eot_id|>", "<|im_end|>", "<end_of_turn>",
                                                "<|end|>", "<|user|>"};

// One BPE symbol of the piece being merged: a doubly linked list over the piece's bytes.
struct Symbol {
  int32_t id;  // -1 for a byte without a token: it takes part in no merge
  int32_t prev;
  int32_t next;  // -1 at the end
};

// A possible merge of symbols[left] with its right neighbour. The ids are those seen when it
// was queued; if either symbol has changed since, the entry is stale and skipped.
struct Candidate {
  int32_t rank;
  int32_t left;
  int32_t left_id;
  int32_t right_id;
  int32_t result_id;
  // Lowest rank first; among equal ranks (the same pair) the leftmost.
  bool operator<(const Candidate& other) const {
    return rank != other.rank ? rank > other.rank : left > other.left;
  }
};

constexpr std::string_view kSentencePieceSpace = "\xE2\x96\x81";  // U+2581

// Bytes of a UTF-8 sequence from its first byte (1 for a stray continuation byte).
size_t Utf8SequenceLength(uint8_t lead) {
  if (lead >= 0xF0 && lead < 0xF8) return 4;
  if (lead >= 0xE0) return lead < 0xF0 ? 3 : 1;
  if (lead >= 0xC0) return 2;
  return 1;
}

// What a SentencePiece token stands for: <0xAB> byte tokens their byte, others their text with
// U+2581 as a space (control and user-defined tokens as written).
std::string SentencePieceBytes(const std::string& text, TokenType type) {
  const auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (type == TokenType::kByte && text.size() == 6 && text.starts_with("<0x") && text[5] == '>' &&
      hex(text[3]) >= 0 && hex(text[4]) >= 0) {
    return std::string(1, static_cast<char>(hex(text[3]) * 16 + hex(text[4])));
  }
  if (type == TokenType::kControl || type == TokenType::kUserDefined) return text;
  std::string bytes;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, kSentencePieceSpace.size(), kSentencePieceSpace) == 0) {
      bytes += ' ';
      i += kSentencePieceSpace.size();
    } else {
      bytes += text[i++];
    }
  }
  return bytes;
}

// Bytes every byte-level vocabulary must spell on its own: without them ordinary text (ASCII,
// or any character of the Basic Multilingual Plane) loses bytes and can encode to nothing. The
// other bytes (most C0 controls, 0xC0, 0xC1, 0xF0..0xFF) are left out by some real
// vocabularies and are dropped from the input, as the reference tokenizers do.
bool IsRequiredByte(int byte) {
  return byte == '\t' || byte == '\n' || (byte >= 0x20 && byte <= 0x7E) ||
         (byte >= 0x80 && byte <= 0xBF) || (byte >= 0xC2 && byte <= 0xEF);
}

// Says which byte has no token and what is wrong with the token texts instead.
Status MissingByteError(int byte, std::string_view mapped, std::span<const std::string> tokens) {
  int64_t num_empty = 0, num_invalid = 0, first_empty = -1, first_invalid = -1;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (tokens[id].empty()) {
      if (num_empty++ == 0) first_empty = static_cast<int64_t>(id);
    } else if (!unicode::IsValidUtf8(tokens[id])) {
      if (num_invalid++ == 0) first_invalid = static_cast<int64_t>(id);
    }
  }
  std::string why;
  if (num_empty > 0)
    why += fmt::format("; {} tokens are empty (first: token {})", num_empty, first_empty);
  if (num_invalid > 0) {
    why += fmt::format("; {} token texts are not valid UTF-8 (first: token {})", num_invalid,
                       first_invalid);
  }
  if (why.empty()) why = "; are the token texts not in GPT-2's byte-to-unicode form?";
  return Error(ErrorCode::kCorrupt,
               "the vocabulary has no token for byte 0x{:02X} (byte-level text '{}'), so text "
               "holding it cannot be encoded{}",
               byte, mapped, why);
}

Result<int32_t> OptionalTokenId(const gguf::GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return -1;
  SKV_ASSIGN_OR_RETURN(const int64_t id, file.GetInt(key));
  return static_cast<int32_t>(id);
}

}  // namespace

std::string ByteLevelText(std::string_view bytes) {
  std::string text;
  MapBytes(bytes, text);
  return text;
}

namespace {

// Ids of the special tokens and the add_bos/add_eos flags, common to both tokenizer models.
Status ReadSpecialTokens(const gguf::GgufFile& file, TokenizerConfig* config) {
  SKV_ASSIGN_OR_RETURN(config->bos_id, OptionalTokenId(file, "tokenizer.ggml.bos_token_id"));
  SKV_ASSIGN_OR_RETURN(config->eos_id, OptionalTokenId(file, "tokenizer.ggml.eos_token_id"));
  SKV_ASSIGN_OR_RETURN(config->eot_id, OptionalTokenId(file, "tokenizer.ggml.eot_token_id"));
  SKV_ASSIGN_OR_RETURN(config->eom_id, OptionalTokenId(file, "tokenizer.ggml.eom_token_id"));
  SKV_ASSIGN_OR_RETURN(config->padding_id,
                       OptionalTokenId(file, "tokenizer.ggml.padding_token_id"));
  if (file.Find("tokenizer.ggml.add_bos_token") != nullptr) {
    SKV_ASSIGN_OR_RETURN(config->add_bos, file.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (file.Find("tokenizer.ggml.add_eos_token") != nullptr) {
    SKV_ASSIGN_OR_RETURN(config->add_eos, file.GetBool("tokenizer.ggml.add_eos_token"));
  }
  return Status::Ok();
}

Status ReadTokenTypes(const gguf::GgufFile& file, TokenizerConfig* config) {
  if (file.Find("tokenizer.ggml.token_type") == nullptr) return Status::Ok();
  SKV_ASSIGN_OR_RETURN(const std::vector<int64_t> types,
                       file.GetIntArray("tokenizer.ggml.token_type"));
  config->token_types.reserve(types.size());
  for (const int64_t type : types) config->token_types.push_back(static_cast<TokenType>(type));
  return Status::Ok();
}

Result<std::unique_ptr<Tokenizer>> FromGgufSentencePiece(const gguf::GgufFile& file) {
  TokenizerConfig config;
  config.sentencepiece = true;
  SKV_ASSIGN_OR_RETURN(config.tokens, file.GetStringArray("tokenizer.ggml.tokens"));
  SKV_RETURN_IF_ERROR(ReadTokenTypes(file, &config));
  if (file.Find("tokenizer.ggml.scores") == nullptr) {
    return Error(ErrorCode::kCorrupt, "SentencePiece tokenizer without tokenizer.ggml.scores");
  }
  SKV_ASSIGN_OR_RETURN(config.scores, file.GetFloatArray("tokenizer.ggml.scores"));
  config.add_bos = true;  // llama.cpp's default for SentencePiece vocabularies
  SKV_RETURN_IF_ERROR(ReadSpecialTokens(file, &config));
  config.add_space_prefix = true;
  if (file.Find("tokenizer.ggml.add_space_prefix") != nullptr) {
    SKV_ASSIGN_OR_RETURN(config.add_space_prefix, file.GetBool("tokenizer.ggml.add_space_prefix"));
  }
  return Tokenizer::Create(std::move(config));
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const gguf::GgufFile& file) {
  SKV_ASSIGN_OR_RETURN(const std::string model, file.GetString("tokenizer.ggml.model"));
  if (model == "llama") return FromGgufSentencePiece(file);
  if (model != "gpt2") {
    return Error(ErrorCode::kUnsupported,
                 "tokenizer model '{}' is not supported; supported: gpt2 (byte-level BPE), llama "
                 "(SentencePiece)",
                 model);
  }
  TokenizerConfig config;
  if (file.Find("tokenizer.ggml.pre") != nullptr) {
    SKV_ASSIGN_OR_RETURN(config.pre, file.GetString("tokenizer.ggml.pre"));
  }
  // Checked before the big arrays are copied, so an unsupported model fails fast.
  SKV_ASSIGN_OR_RETURN(const PreTokenizerType pre_type, ParsePreTokenizerType(config.pre));

  SKV_ASSIGN_OR_RETURN(config.tokens, file.GetStringArray("tokenizer.ggml.tokens"));
  SKV_RETURN_IF_ERROR(ReadTokenTypes(file, &config));
  if (file.Find("tokenizer.ggml.merges") == nullptr) {
    return Error(ErrorCode::kCorrupt, "BPE tokenizer without tokenizer.ggml.merges");
  }
  SKV_ASSIGN_OR_RETURN(config.merges, file.GetStringArray("tokenizer.ggml.merges"));
  // Llama 3 vocabularies expect a BOS unless the file says otherwise; GLM-4's split is Llama 3's
  // but its prompts open with the template's [gMASK]<sop>, never a BOS (llama.cpp drops it too).
  config.add_bos =
      pre_type == PreTokenizerType::kLlama3 && config.pre != "chatglm-bpe" && config.pre != "glm4";
  SKV_RETURN_IF_ERROR(ReadSpecialTokens(file, &config));
  return Create(std::move(config));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Create(TokenizerConfig config) {
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer());
  SKV_RETURN_IF_ERROR(tokenizer->Build(std::move(config)));
  return tokenizer;
}

Status Tokenizer::Build(TokenizerConfig config) {
  SKV_ASSIGN_OR_RETURN(pre_type_, ParsePreTokenizerType(config.pre));
  ignore_merges_ = pre_type_ == PreTokenizerType::kLlama3;
  if (config.tokens.empty()) return Error(ErrorCode::kCorrupt, "tokenizer has no tokens");
  if (config.tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return Error(ErrorCode::kCorrupt, "tokenizer has {} tokens", config.tokens.size());
  }
  const int32_t num_tokens = static_cast<int32_t>(config.tokens.size());
  if (config.token_types.empty()) config.token_types.assign(num_tokens, TokenType::kNormal);
  if (config.token_types.size() != config.tokens.size()) {
    return Error(ErrorCode::kCorrupt, "tokenizer has {} tokens but {} token types",
                 config.tokens.size(), config.token_types.size());
  }
  for (int32_t id = 0; id < num_tokens; ++id) {
    const auto type = static_cast<int32_t>(config.token_types[id]);
    if (type < 0 || type > static_cast<int32_t>(TokenType::kByte)) {
      return Error(ErrorCode::kCorrupt, "token {} has type {}; token types are 0..6", id, type);
    }
  }
  for (const int32_t* id :
       {&config.bos_id, &config.eos_id, &config.eot_id, &config.eom_id, &config.padding_id}) {
    if (*id < -1 || *id >= num_tokens) {
      return Error(ErrorCode::kCorrupt, "special token id {} is outside the vocabulary of {}", *id,
                   num_tokens);
    }
  }

  sentencepiece_ = config.sentencepiece;
  add_space_prefix_ = sentencepiece_ && config.add_space_prefix;
  if (sentencepiece_) {
    if (config.scores.size() != config.tokens.size()) {
      return Error(ErrorCode::kCorrupt, "tokenizer has {} tokens but {} scores",
                   config.tokens.size(), config.scores.size());
    }
    for (size_t id = 0; id < config.scores.size(); ++id) {
      if (!std::isfinite(config.scores[id])) {
        return Error(ErrorCode::kCorrupt, "token {} has score {}", id, config.scores[id]);
      }
    }
    scores_ = std::move(config.scores);
  }
  tokens_ = std::move(config.tokens);
  token_types_ = std::move(config.token_types);
  token_ids_.reserve(tokens_.size());
  token_bytes_.reserve(tokens_.size());
  for (int32_t id = 0; id < num_tokens; ++id) {
    token_ids_.emplace(tokens_[id], id);  // the first of duplicate texts wins
    const TokenType type = token_types_[id];
    const bool plain_text = type == TokenType::kControl || type == TokenType::kUserDefined;
    if (sentencepiece_) {
      token_bytes_.push_back(SentencePieceBytes(tokens_[id], type));
    } else {
      token_bytes_.push_back(plain_text ? tokens_[id] : UnmapBytes(tokens_[id]));
    }
  }

  std::string mapped;
  for (int byte = 0; byte < (sentencepiece_ ? 256 : 0); ++byte) {
    // <0xAB> tokens: the fallback for characters the vocabulary does not spell.
    byte_token_ids_[byte] = FindToken(fmt::format("<0x{:02X}>", byte));
  }
  for (int byte = 0; byte < (sentencepiece_ ? 0 : 256); ++byte) {
    const char raw = static_cast<char>(byte);
    MapBytes(std::string_view(&raw, 1), mapped);
    // Some vocabularies leave out bytes that never occur in UTF-8 text (0xC0, 0xFF) or rare
    // controls; such bytes are dropped from the output, as the reference tokenizers do.
    byte_token_ids_[byte] = FindToken(mapped);
    if (byte_token_ids_[byte] < 0 && IsRequiredByte(byte)) {
      return MissingByteError(byte, mapped, tokens_);
    }
  }

  merges_.reserve(config.merges.size());
  for (size_t rank = 0; rank < config.merges.size(); ++rank) {
    const std::string& merge = config.merges[rank];
    // Token texts hold no spaces, so the first one separates the pair; it is searched from
    // index 1 so that a (malformed) leading space stays in the left part.
    const size_t space = merge.find(' ', 1);
    if (space == std::string::npos) {
      return Error(ErrorCode::kCorrupt, "merge {} '{}' is not a pair", rank, merge);
    }
    const std::string_view left(merge.data(), space);
    const std::string_view right(merge.data() + space + 1, merge.size() - space - 1);
    const int32_t left_id = FindToken(left);
    const int32_t right_id = FindToken(right);
    const int32_t result_id = FindToken(std::string(left) + std::string(right));
    // A merge whose parts or result are not tokens can never apply to token ids.
    if (left_id < 0 || right_id < 0 || result_id < 0) continue;
    merges_.emplace(PairKey(left_id, right_id), Merge{static_cast<int32_t>(rank), result_id});
  }

  for (int32_t id = 0; id < num_tokens; ++id) {
    const TokenType type = token_types_[id];
    if ((type == TokenType::kControl || type == TokenType::kUserDefined) && !tokens_[id].empty()) {
      special_by_first_byte_[static_cast<uint8_t>(tokens_[id][0])].push_back(id);
    }
  }
  for (auto& bucket : special_by_first_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](int32_t a, int32_t b) { return tokens_[a].size() > tokens_[b].size(); });
  }

  bos_id_ = config.bos_id;
  eos_id_ = config.eos_id;
  eot_id_ = config.eot_id;
  eom_id_ = config.eom_id;
  padding_id_ = config.padding_id;
  add_bos_ = config.add_bos && bos_id_ >= 0;
  add_eos_ = config.add_eos && eos_id_ >= 0;
  if (eot_id_ < 0) {
    for (const std::string_view text : kEndOfTurnTexts) {
      if ((eot_id_ = FindToken(text)) >= 0) break;
    }
  }
  for (const int32_t id : {eos_id_, eot_id_, eom_id_}) {
    if (id >= 0) end_of_generation_ids_.insert(id);
  }
  for (const std::string_view text : kEndOfGenerationTexts) {
    if (const int32_t id = FindToken(text); id >= 0) end_of_generation_ids_.insert(id);
  }

  matched_in_plain_text_.assign(num_tokens, false);
  for (int32_t id = 0; id < num_tokens; ++id) {
    matched_in_plain_text_[id] =
        token_types_[id] == TokenType::kUserDefined && !end_of_generation_ids_.contains(id);
  }
  for (const int32_t id : {bos_id_, eos_id_, eot_id_, eom_id_, padding_id_}) {
    if (id >= 0) matched_in_plain_text_[id] = false;
  }
  for (const std::string_view text : kTurnMarkerTexts) {
    if (const int32_t id = FindToken(text); id >= 0) matched_in_plain_text_[id] = false;
  }
  return Status::Ok();
}

int32_t Tokenizer::FindToken(std::string_view text) const {
  const auto it = token_ids_.find(text);
  return it == token_ids_.end() ? -1 : it->second;
}

const std::string& Tokenizer::TokenText(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? tokens_[id] : kEmpty;
}

std::string_view Tokenizer::TokenBytes(int32_t id) const {
  return id >= 0 && id < vocab_size() ? std::string_view(token_bytes_[id]) : std::string_view();
}

TokenType Tokenizer::GetTokenType(int32_t id) const {
  return id >= 0 && id < vocab_size() ? token_types_[id] : TokenType::kUndefined;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  const TextSegment segment{text, parse_special};
  return Encode(std::span<const TextSegment>(&segment, 1), add_special);
}

int32_t Tokenizer::MatchSpecial(std::string_view text, size_t pos, bool parse_special) const {
  for (const int32_t id : special_by_first_byte_[static_cast<uint8_t>(text[pos])]) {
    if (!parse_special && !matched_in_plain_text_[id]) continue;
    if (text.substr(pos).starts_with(tokens_[id])) return id;
  }
  return -1;
}

std::vector<int32_t> Tokenizer::Encode(std::span<const TextSegment> segments,
                                       bool add_special) const {
  size_t total_size = 0;
  for (const TextSegment& segment : segments) total_size += segment.text.size();
  std::vector<int32_t> out;
  out.reserve(total_size / 3 + 2);
  if (add_special && add_bos_) out.push_back(bos_id_);

  // Special tokens are cut out first, leftmost and then longest; the text between them is
  // tokenized on its own, so pre-tokenizer pieces never straddle a special token. That text may
  // run over several segments: it is gathered in `run` (copied only when it does).
  std::string run;
  std::string_view pending;  // the run so far when it lies within one segment
  const auto flush = [&] {
    if (run.empty()) {
      EncodeText(pending, out);
    } else {
      run.append(pending);
      EncodeText(run, out);
      run.clear();
    }
    pending = {};
  };
  for (const TextSegment& segment : segments) {
    const std::string_view text = segment.text;
    if (!pending.empty()) {
      run.append(pending);
      pending = {};
    }
    size_t text_start = 0;
    for (size_t pos = 0; pos < text.size();) {
      const int32_t matched = MatchSpecial(text, pos, segment.parse_special);
      if (matched < 0) {
        ++pos;
        continue;
      }
      pending = text.substr(text_start, pos - text_start);
      flush();
      out.push_back(matched);
      pos += tokens_[matched].size();
      text_start = pos;
    }
    pending = text.substr(text_start);
  }
  flush();

  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

void Tokenizer::EncodeText(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  if (sentencepiece_) {
    EncodeSentencePiece(text, out);
    return;
  }
  std::vector<std::string_view> pieces;
  PreTokenize(pre_type_, text, pieces);
  std::string scratch;
  for (const std::string_view piece : pieces) EncodePiece(piece, scratch, out);
}

void Tokenizer::EncodePiece(std::string_view piece, std::string& scratch,
                            std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    if (const int32_t id = byte_token_ids_[static_cast<uint8_t>(piece[0])]; id >= 0) {
      out.push_back(id);
    }
    return;
  }
  if (ignore_merges_) {
    MapBytes(piece, scratch);
    if (const int32_t id = FindToken(scratch); id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // Reused across calls: most pieces are short, and allocation would dominate.
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> queue;  // a heap, best candidate at the front
  symbols.clear();
  queue.clear();
  const int32_t num_symbols = static_cast<int32_t>(piece.size());
  for (int32_t i = 0; i < num_symbols; ++i) {
    symbols.push_back(
        {byte_token_ids_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < num_symbols ? i + 1 : -1});
  }
  const auto enqueue = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    const auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
    if (it == merges_.end()) return;
    queue.push_back(
        {it->second.rank, left, symbols[left].id, symbols[right].id, it->second.result_id});
    std::push_heap(queue.begin(), queue.end());
  };
  for (int32_t i = 0; i + 1 < num_symbols; ++i) enqueue(i);

  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end());
    const Candidate candidate = queue.back();
    queue.pop_back();
    Symbol& left = symbols[candidate.left];
    if (left.id != candidate.left_id || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != candidate.right_id) continue;
    left.id = candidate.result_id;
    right.id = -1;  // unlinked; stale candidates naming it fail the id checks
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = candidate.left;
    enqueue(left.prev);
    enqueue(candidate.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    if (symbols[i].id >= 0) out.push_back(symbols[i].id);  // bytes without a token are dropped
  }
}

void Tokenizer::EncodeSentencePiece(std::string_view text, std::vector<int32_t>& out) const {
  // Spaces are spelled U+2581; each run of text starts after the BOS or a special token, where
  // llama.cpp adds the space prefix.
  std::string escaped(add_space_prefix_ ? kSentencePieceSpace : std::string_view());
  for (const char c : text) {
    if (c == ' ') {
      escaped += kSentencePieceSpace;
    } else {
      escaped += c;
    }
  }
  // Symbols are the characters (a malformed UTF-8 byte is one symbol), linked as in EncodePiece;
  // a symbol spans escaped[start, start + length).
  struct Piece {
    int32_t start, length, prev, next;
  };
  struct Bigram {
    float score;
    int32_t left, length;                        // length of the merged text, to tell stale entries
    bool operator<(const Bigram& other) const {  // highest score first, then leftmost
      return score != other.score ? score < other.score : left > other.left;
    }
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < escaped.size();) {
    const size_t length =
        std::min(Utf8SequenceLength(static_cast<uint8_t>(escaped[i])), escaped.size() - i);
    const int32_t index = static_cast<int32_t>(pieces.size());
    pieces.push_back({static_cast<int32_t>(i), static_cast<int32_t>(length), index - 1, index + 1});
    i += length;
  }
  if (pieces.empty()) return;
  pieces.back().next = -1;
  std::vector<Bigram> queue;
  const auto enqueue = [&](int32_t left) {
    if (left < 0 || pieces[left].next < 0) return;
    const Piece& a = pieces[left];
    const int32_t length = a.length + pieces[a.next].length;
    const int32_t id = FindToken(std::string_view(escaped).substr(a.start, length));
    if (id < 0) return;
    queue.push_back({scores_[id], left, length});
    std::push_heap(queue.begin(), queue.end());
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(pieces.size()); ++i) enqueue(i);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end());
    const Bigram bigram = queue.back();
    queue.pop_back();
    Piece& left = pieces[bigram.left];
    if (left.length == 0 || left.next < 0 ||
        left.length + pieces[left.next].length != bigram.length) {
      continue;  // a side has merged since
    }
    Piece& right = pieces[left.next];
    left.length += right.length;
    right.length = 0;
    left.next = right.next;
    if (left.next >= 0) pieces[left.next].prev = bigram.left;
    enqueue(left.prev);
    enqueue(bigram.left);
  }
  for (int32_t i = 0; i >= 0; i = pieces[i].next) {
    const std::string_view piece =
        std::string_view(escaped).substr(pieces[i].start, pieces[i].length);
    if (const int32_t id = FindToken(piece); id >= 0) {
      out.push_back(id);
      continue;
    }
    for (const char byte : piece) {  // byte fallback; a byte without a token is dropped
      if (const int32_t id = byte_token_ids_[static_cast<uint8_t>(byte)]; id >= 0) {
        out.push_back(id);
      }
    }
  }
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string text;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    const TokenType type = token_types_[id];
    if (skip_special && (type == TokenType::kControl || type == TokenType::kUnknown)) continue;
    text += token_bytes_[id];
  }
  return text;
}

std::string StreamingDecoder::Push(int32_t id) {
  const TokenType type = tokenizer_.GetTokenType(id);
  if (skip_special_ && (type == TokenType::kControl || type == TokenType::kUnknown)) return {};
  pending_ += tokenizer_.TokenBytes(id);
  const size_t complete = unicode::CompleteUtf8PrefixLength(pending_);
  std::string text;
  unicode::AppendValidUtf8(std::string_view(pending_).substr(0, complete), text);
  pending_.erase(0, complete);
  return text;
}

std::string StreamingDecoder::Flush() {
  std::string text = pending_.empty() ? "" : "\xEF\xBF\xBD";
  pending_.clear();
  return text;
}

}  // namespace shadowkv

// Task prompts in a chat template (answer prefix after the assistant header) and follow-up turns.
#include "eval/prompt_format.h"

#include <gtest/gtest.h>

namespace shadowkv::eval {
namespace {

const PromptParts kFirst = {"Find the number.\nText here.\nWhat is it?", " The number is"};
const PromptParts kNext = {"And the other one?", " The other number is"};

TEST(PromptFormatTest, PlainIsRulersBaseTemplate) {
  const PromptFormat plain = PromptFormat::Plain();
  EXPECT_EQ(plain.First(kFirst), "Find the number.\nText here.\nWhat is it? The number is");
  EXPECT_EQ(plain.Followup(kNext), "\nAnd the other one? The other number is");
  EXPECT_EQ(plain.name(), "plain");
}

TEST(PromptFormatTest, ChatMLPutsThePrefixAfterTheAssistantHeader) {
  const PromptFormat chat = PromptFormat::Chat({ChatFormat::kChatML, "You are helpful."});
  EXPECT_EQ(chat.First(kFirst),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n"
            "<|im_start|>user\nFind the number.\nText here.\nWhat is it?<|im_end|>\n"
            "<|im_start|>assistant\nThe number is");
  // After the model's answer: close its turn, ask, open the next answer.
  EXPECT_EQ(chat.Followup(kNext),
            "<|im_end|>\n<|im_start|>user\nAnd the other one?<|im_end|>\n"
            "<|im_start|>assistant\nThe other number is");
}

TEST(PromptFormatTest, Llama3FollowupClosesTheTurnWithEotId) {
  const PromptFormat chat = PromptFormat::Chat({ChatFormat::kLlama3, ""});
  EXPECT_EQ(chat.Followup(kNext),
            "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd the other one?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nThe other number is");
}

}  // namespace
}  // namespace shadowkv::eval

// Haystack text: prose extraction from a marked-up file, needle placement by depth.
#include "eval/haystack.h"

#include <gtest/gtest.h>

#include <fstream>

namespace shadowkv::eval {
namespace {

TEST(HaystackTest, ExtractProseDropsMarkupHeadwordsAndShortLines) {
  const std::string text =
      "   Table of Contents\n\n   I. Introduction\n\n"
      "   :cruft: /kruhft/\n\n"
      "   An unpleasant substance. The dust that gathers under your bed is cruft; see {kludge}\n"
      "   and \u201Cbletch\u201D \u2014 the classic example of what one means by it here.\n\n"
      "   \u2550\u2550\u2550\u2550\n";
  const std::vector<std::string> words = ExtractProseWords(text, 12);
  ASSERT_FALSE(words.empty());
  EXPECT_EQ(words.front(), "An");
  EXPECT_EQ(words.back(), "here.");
  std::string joined;
  for (const auto& w : words) joined += w + " ";
  EXPECT_EQ(joined.find('{'), std::string::npos);
  EXPECT_NE(joined.find("see kludge and \"bletch\" -- the"), std::string::npos) << joined;
  EXPECT_EQ(joined.find("Contents"), std::string::npos);
  EXPECT_EQ(joined.find(":cruft:"), std::string::npos);
}

EssayCorpus TenSentences() {
  EssayCorpus corpus;
  for (int s = 0; s < 10; ++s) {
    for (int w = 0; w < 9; ++w) corpus.words.push_back("w" + std::to_string(s));
    corpus.words.push_back("end" + std::to_string(s) + ".");
  }
  return corpus;
}

TEST(HaystackTest, EssayInsertionGoesToTheSentenceAtTheDepth) {
  const EssayCorpus corpus = TenSentences();
  std::vector<double> placed;
  const Insertion middle[] = {{50.0, "NEEDLE."}};
  const std::string text = BuildEssayContext(corpus, 0, 100, middle, &placed);
  // Five sentences (50 words) come before it.
  EXPECT_NE(text.find("end4. NEEDLE. w5"), std::string::npos) << text;
  EXPECT_DOUBLE_EQ(placed[0], 50.0);

  const Insertion ends[] = {{100.0, "LAST."}, {0.0, "FIRST."}, {0.0, "SECOND."}};
  const std::string edges = BuildEssayContext(corpus, 0, 100, ends, &placed);
  EXPECT_EQ(edges.rfind("FIRST. SECOND. w0", 0), 0u) << edges;
  EXPECT_TRUE(edges.ends_with("end9. LAST.")) << edges;
  EXPECT_DOUBLE_EQ(placed[0], 100.0);
  EXPECT_DOUBLE_EQ(placed[1], 0.0);
}

TEST(HaystackTest, EssayWrapsAroundTheCorpusFromTheOffset) {
  const EssayCorpus corpus = TenSentences();
  const std::string text = BuildEssayContext(corpus, 95, 10, {}, nullptr);
  EXPECT_EQ(text, "w9 w9 w9 w9 end9. w0 w0 w0 w0 w0");
}

TEST(HaystackTest, LineInsertionGoesBeforeTheLineAtTheDepth) {
  const std::vector<std::string> lines = {"a", "b", "c", "d"};
  const Insertion needles[] = {{50.0, "N"}, {100.0, "Z"}, {0.0, "A"}};
  std::vector<double> placed;
  EXPECT_EQ(BuildLineContext(lines, needles, &placed), "A\na\nb\nN\nc\nd\nZ");
  EXPECT_EQ(placed, (std::vector<double>{50.0, 100.0, 0.0}));
}

TEST(HaystackTest, DefaultCorpusIsTheJargonFileProse) {
  if (!std::ifstream(std::string(kDefaultEssayPath))) GTEST_SKIP() << "jargon-text not installed";
  auto corpus = LoadEssayCorpus("");
  ASSERT_TRUE(corpus.ok()) << corpus.status().ToString();
  EXPECT_GT(corpus->words.size(), 100000u);  // the File has about 240K words in all
  const std::vector<std::string> vocabulary = CorpusVocabulary(*corpus);
  EXPECT_GT(vocabulary.size(), 5000u);
  EXPECT_TRUE(std::is_sorted(vocabulary.begin(), vocabulary.end()));
  for (const std::string& word : vocabulary) {
    ASSERT_TRUE(word.size() >= 3 && word.size() <= 10) << word;
    for (char c : word) ASSERT_TRUE(c >= 'a' && c <= 'z') << word;
  }
}

TEST(HaystackTest, MissingFileIsNotFound) {
  auto corpus = LoadEssayCorpus("/nonexistent/essay.txt");
  EXPECT_EQ(corpus.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(LoadEssayCorpus("/nonexistent/essay.txt.gz").status().code(), ErrorCode::kNotFound);
}

}  // namespace
}  // namespace shadowkv::eval

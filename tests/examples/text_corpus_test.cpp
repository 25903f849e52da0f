// The text corpus reader: the token stream of a file (words, then <eos> per line), the vocabulary
// of the training file, unknown words in the other files, and the cut into sequences.
#include "examples/text_corpus.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using shampoo::examples::cut_into_sequences;
using shampoo::examples::load_text_corpus;
using shampoo::examples::read_token_stream;
using shampoo::examples::sequence_tail;
using shampoo::examples::Vocabulary;

fs::path test_dir(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("text_corpus_test_" + name);
  fs::create_directories(dir);
  return dir;
}

void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

std::vector<int64_t> values(const at::Tensor& t) {
  const auto c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

/// The words of a stream, joined by spaces.
std::string words(const at::Tensor& stream, const Vocabulary& vocabulary) {
  std::string text;
  for (const int64_t id : values(stream)) text += (text.empty() ? "" : " ") + vocabulary.word(id);
  return text;
}

TEST(TextCorpus, EveryLineGivesItsWordsThenEos) {
  const auto dir = test_dir("lines");
  // Mikolov's layout (a leading and a trailing space), a tab, a blank line, no final newline.
  write(dir / "a.txt", " the cat sat \n a\tcat ran\n\n the end");
  Vocabulary vocabulary;
  const auto stream = read_token_stream(dir / "a.txt", vocabulary, /*extend=*/true);
  EXPECT_EQ(stream.scalar_type(), at::kLong);
  EXPECT_EQ(words(stream, vocabulary), "the cat sat <eos> a cat ran <eos> <eos> the end <eos>");
  // Ids in order of first appearance.
  EXPECT_EQ(values(stream), (std::vector<int64_t>{0, 1, 2, 3, 4, 1, 5, 3, 3, 0, 6, 3}));
  EXPECT_EQ(vocabulary.size(), 7);
  EXPECT_EQ(vocabulary.find("<eos>"), 3);
  EXPECT_EQ(vocabulary.find("dog"), -1);
}

TEST(TextCorpus, ValidationAndTestWordsOutsideTheVocabularyAreUnk) {
  const auto dir = test_dir("unk");
  write(dir / "ptb.train.txt", " a b <unk> \n b a \n");
  write(dir / "ptb.valid.txt", " a zebra \n");
  write(dir / "ptb.test.txt", " b \n b a \n");
  const auto corpus = load_text_corpus(dir);
  EXPECT_EQ(corpus.vocabulary.size(), 4);  // a b <unk> <eos>
  EXPECT_EQ(words(corpus.train, corpus.vocabulary), "a b <unk> <eos> b a <eos>");
  EXPECT_EQ(words(corpus.valid, corpus.vocabulary), "a <unk> <eos>");
  EXPECT_EQ(words(corpus.test, corpus.vocabulary), "b <eos> b a <eos>");
}

TEST(TextCorpus, MissingFilesAndUnknownWordsWithoutUnkAreErrorsNamingTheFile) {
  const auto dir = test_dir("errors");
  write(dir / "ptb.train.txt", " a b \n");
  write(dir / "ptb.valid.txt", " a c \n");
  write(dir / "ptb.test.txt", " a \n");
  try {
    load_text_corpus(dir);
    FAIL() << "a word outside a vocabulary without <unk> should be an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("ptb.valid.txt: the word 'c' is not in the training file's "
                           "vocabulary, which has no <unk>"),
              std::string::npos)
        << e.msg();
  }
  fs::remove(dir / "ptb.test.txt");
  write(dir / "ptb.valid.txt", " a \n");
  try {
    load_text_corpus(dir);
    FAIL() << "a missing file should be an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("cannot read " + (dir / "ptb.test.txt").string()), std::string::npos)
        << e.msg();
  }
  try {
    load_text_corpus(dir / "absent");
    FAIL() << "a missing folder should be an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("is not a directory"), std::string::npos) << e.msg();
  }
}

TEST(TextCorpus, SequencesAreWindowsOverlappingByOneTokenAndTheTailHoldsTheRest) {
  const auto stream = torch::arange(11, torch::kLong);  // tokens 0..10
  const auto sequences = cut_into_sequences(stream, 3);
  // (11 - 1) / 3 = 3 windows of 4 tokens: inputs 0-2, 3-5, 6-8 and their targets 1-3, 4-6, 7-9.
  ASSERT_EQ(sequences.sizes().vec(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(values(sequences), (std::vector<int64_t>{0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9}));
  // Every token after the first is a target exactly once, the tail's included.
  EXPECT_EQ(values(sequence_tail(stream, 3)), (std::vector<int64_t>{9, 10}));
  // Windows that cover the stream leave a tail of one token, no target.
  EXPECT_EQ(values(sequence_tail(torch::arange(10, torch::kLong), 3)), (std::vector<int64_t>{9}));
  EXPECT_EQ(cut_into_sequences(torch::arange(10, torch::kLong), 3).size(0), 3);
  // Too short for one window: none, and the tail is the stream.
  EXPECT_EQ(cut_into_sequences(torch::arange(3, torch::kLong), 3).size(0), 0);
  EXPECT_EQ(values(sequence_tail(torch::arange(3, torch::kLong), 3)),
            (std::vector<int64_t>{0, 1, 2}));
  EXPECT_THROW(cut_into_sequences(stream, 0), c10::Error);
}

}  // namespace

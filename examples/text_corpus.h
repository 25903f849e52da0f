#pragma once
/// A word-level text corpus for language modelling, in the layout of Mikolov's preprocessed Penn
/// Treebank (ptb.train.txt, ptb.valid.txt, ptb.test.txt: one sentence per line, words separated
/// by spaces, rare words already replaced by <unk>, 10 000 words in all).
///
/// Tokens: every line of a file gives its whitespace-separated words and then the end-of-sentence
/// token <eos> (a blank line gives <eos> alone), in file order, as one stream; the same
/// convention as PyTorch's word_language_model example. The vocabulary is built from the
/// training file in order of first appearance; a validation or test word outside it is read as
/// <unk> when the vocabulary has <unk>, else it is an error naming the file and the word.
///
/// Sequences: the trainer cuts a stream into consecutive windows of bptt + 1 tokens that
/// overlap by one token (window k = tokens k·bptt ... k·bptt + bptt): the first bptt tokens are
/// the model's input, the last bptt its targets, so every token after the first is a target
/// exactly once. These are the segments of the usual batchified stream; the trainer resets the
/// LSTM state for every sequence, so their order is free and they are shuffled like images.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shampoo::examples {

inline constexpr std::string_view kEndOfSentence = "<eos>";
inline constexpr std::string_view kUnknownWord = "<unk>";
/// The three files of a corpus folder.
inline constexpr std::string_view kPtbTrainFile = "ptb.train.txt";
inline constexpr std::string_view kPtbValidFile = "ptb.valid.txt";
inline constexpr std::string_view kPtbTestFile = "ptb.test.txt";

/// Word ↔ id, ids 0 .. size() − 1 in order of first appearance.
class Vocabulary {
 public:
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  /// The id of `word`, adding it when new.
  int64_t add(const std::string& word);
  /// The id of `word`, or −1 when absent.
  int64_t find(const std::string& word) const;
  const std::string& word(int64_t id) const { return words_.at(static_cast<size_t>(id)); }

 private:
  std::vector<std::string> words_;
  std::unordered_map<std::string, int64_t> ids_;
};

/// Reads `file` as a token stream (int64 [tokens] on the CPU). With `extend` new words are added
/// to `vocabulary`; without it they are read as <unk> when the vocabulary has it, else they are an
/// error. Throws c10::Error naming the file when it is missing, unreadable or holds no token.
at::Tensor read_token_stream(const std::filesystem::path& file, Vocabulary& vocabulary,
                             bool extend);

/// The token streams of a corpus folder (int64 [tokens] each, on the CPU).
struct TextCorpus {
  Vocabulary vocabulary;
  at::Tensor train;
  at::Tensor valid;
  at::Tensor test;
};

/// Reads dir/ptb.train.txt (building the vocabulary), dir/ptb.valid.txt and dir/ptb.test.txt.
/// A missing file is an error naming it and saying how to install the corpus.
TextCorpus load_text_corpus(const std::filesystem::path& dir);

/// The folder the trainer reads --dataset ptb from when --data-dir is not given: where
/// scripts/install_deps.sh writes the corpus (CMake passes it in; SHAMPOO_PTB_DIR).
std::filesystem::path default_ptb_dir();

/// The stream cut into windows of bptt + 1 tokens overlapping by one (see the top of this file):
/// int64 [floor((tokens − 1) / bptt), bptt + 1]. The last tokens that do not fill a window are
/// left out (use sequence_tail for them). Throws c10::Error when bptt < 1.
at::Tensor cut_into_sequences(const at::Tensor& stream, int64_t bptt);

/// The tokens after the last full window, with the window's last token first (the context of the
/// next target): int64 [1 + (tokens − 1) mod bptt]; one token (no target) when the windows cover
/// the stream.
at::Tensor sequence_tail(const at::Tensor& stream, int64_t bptt);

}  // namespace shampoo::examples

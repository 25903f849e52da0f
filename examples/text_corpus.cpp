#include "examples/text_corpus.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>
#include <system_error>

namespace shampoo::examples {

int64_t Vocabulary::add(const std::string& word) {
  const auto [it, inserted] = ids_.try_emplace(word, size());
  if (inserted) words_.push_back(word);
  return it->second;
}

int64_t Vocabulary::find(const std::string& word) const {
  const auto it = ids_.find(word);
  return it == ids_.end() ? -1 : it->second;
}

at::Tensor read_token_stream(const std::filesystem::path& file, Vocabulary& vocabulary,
                             bool extend) {
  std::ifstream in(file);
  TORCH_CHECK(in.good(), "text corpus: cannot read ", file.string(),
              " (scripts/install_deps.sh writes the Penn Treebank's files; or pass --data-dir)");
  const std::string eos(kEndOfSentence);
  const int64_t unknown = vocabulary.find(std::string(kUnknownWord));
  std::vector<int64_t> ids;
  std::string line;
  std::string word;
  auto id_of = [&](const std::string& w) {
    if (extend) return vocabulary.add(w);
    const int64_t id = vocabulary.find(w);
    if (id >= 0) return id;
    TORCH_CHECK(unknown >= 0, "text corpus: ", file.string(), ": the word '", w,
                "' is not in the training file's vocabulary, which has no ", kUnknownWord);
    return unknown;
  };
  while (std::getline(in, line)) {
    std::istringstream words(line);
    while (words >> word) ids.push_back(id_of(word));
    ids.push_back(id_of(eos));
  }
  TORCH_CHECK(!in.bad(), "text corpus: error while reading ", file.string());
  TORCH_CHECK(ids.size() >= 2, "text corpus: ", file.string(), " holds ", ids.size(),
              " token(s), expected at least 2 (an input and its target)");
  return at::from_blob(ids.data(), {static_cast<int64_t>(ids.size())}, at::kLong).clone();
}

TextCorpus load_text_corpus(const std::filesystem::path& dir) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::is_directory(dir, ec), "text corpus: ", dir.string(),
              " is not a directory; scripts/install_deps.sh (make deps) writes the Penn "
              "Treebank there, or pass --data-dir with a folder holding ",
              kPtbTrainFile, ", ", kPtbValidFile, " and ", kPtbTestFile);
  TextCorpus corpus;
  corpus.train = read_token_stream(dir / kPtbTrainFile, corpus.vocabulary, /*extend=*/true);
  corpus.valid = read_token_stream(dir / kPtbValidFile, corpus.vocabulary, /*extend=*/false);
  corpus.test = read_token_stream(dir / kPtbTestFile, corpus.vocabulary, /*extend=*/false);
  return corpus;
}

std::filesystem::path default_ptb_dir() {
#ifdef SHAMPOO_PTB_DEFAULT_DIR
  return std::filesystem::path(SHAMPOO_PTB_DEFAULT_DIR);
#else
  return std::filesystem::path("data/ptb");
#endif
}

at::Tensor cut_into_sequences(const at::Tensor& stream, int64_t bptt) {
  TORCH_CHECK(bptt >= 1, "--bptt: got ", bptt, ", expected >= 1");
  TORCH_CHECK(stream.dim() == 1, "cut_into_sequences: stream: got ", stream.sizes(),
              ", expected [tokens]");
  const int64_t windows = stream.numel() >= 1 ? (stream.numel() - 1) / bptt : 0;
  if (windows == 0) return stream.new_empty({0, bptt + 1});
  // unfold: window k starts at k·bptt and has bptt + 1 tokens (a view; contiguous copy).
  return stream.slice(0, 0, windows * bptt + 1).unfold(0, bptt + 1, bptt).contiguous();
}

at::Tensor sequence_tail(const at::Tensor& stream, int64_t bptt) {
  TORCH_CHECK(bptt >= 1, "--bptt: got ", bptt, ", expected >= 1");
  const int64_t windows = stream.numel() >= 1 ? (stream.numel() - 1) / bptt : 0;
  return stream.slice(0, windows * bptt).contiguous();
}

}  // namespace shampoo::examples

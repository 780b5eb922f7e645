#include "corpus.h"

#include <fstream>
#include <iterator>
#include <stdexcept>

namespace gpt {

int64_t encode(char c) {
  if (c == '\n') return kVocabSize - 1;
  if (c < 32 || c > 126) c = '?';
  return c - 32;
}

char decode(int64_t id) { return id == kVocabSize - 1 ? '\n' : static_cast<char>(id + 32); }

Corpus load_corpus(const std::vector<std::string>& files) {
  std::vector<int64_t> ids;
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("gpt: cannot read corpus file " + path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (char c : text) ids.push_back(encode(c));
  }
  if (ids.size() < 1000) throw std::runtime_error("gpt: the corpus has under 1000 characters");
  auto all = torch::tensor(ids, torch::kInt64);
  const auto cut = all.size(0) * 9 / 10;
  return {all.narrow(0, 0, cut), all.narrow(0, cut, all.size(0) - cut)};
}

}  // namespace gpt

// defines: Corpus, a character-level text corpus (the fortunes package's
// files by default) as token ids, split into training and validation text.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace gpt {

/// Where Debian's fortunes package puts its text files.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

/// Printable ASCII (32..126) and newline: 96 tokens, which divides by tp
/// = 1, 2, 3, 4, 6, 8. Other bytes read as '?'.
inline constexpr int64_t kVocabSize = 96;

/// The text as ids: the first 90% to train on, the rest to validate.
struct Corpus {
  torch::Tensor train;       ///< int64 ids
  torch::Tensor validation;  ///< int64 ids
};

/// Reads `files` (throws std::runtime_error naming a file it cannot read).
Corpus load_corpus(const std::vector<std::string>& files);

/// Id of a character, and back.
int64_t encode(char c);
char decode(int64_t id);

}  // namespace gpt

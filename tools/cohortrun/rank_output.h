// defines: RankOutput — one rank's stdout and stderr, prefixed with its
// global rank, forwarded to the launcher's own streams, with the last lines
// kept for failure reports.
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>

#include "line_splitter.h"

namespace cohortrun {

enum class Stream { kOut, kErr };

class RankOutput {
 public:
  static constexpr size_t kTailLines = 10;

  // `shown` false (--quiet-others) still records the tail: a quiet rank's
  // last words are what explains its failure.
  RankOutput(int rank, bool shown);

  void on_bytes(Stream stream, std::string_view data);
  void on_eof(Stream stream);

  // The last kTailLines lines of both streams in arrival order, prefixed.
  const std::deque<std::string>& tail() const { return tail_; }

 private:
  void on_line(Stream stream, std::string_view line);

  bool shown_;
  std::string prefix_;  // "[rank] "
  LineSplitter out_;
  LineSplitter err_;
  std::deque<std::string> tail_;
};

}  // namespace cohortrun

#include "rank_output.h"

#include <unistd.h>

#include "output.h"

namespace cohortrun {

RankOutput::RankOutput(int rank, bool shown)
    : shown_(shown), prefix_("[" + std::to_string(rank) + "] ") {}

void RankOutput::on_bytes(Stream stream, std::string_view data) {
  auto emit = [&](std::string_view line) { on_line(stream, line); };
  (stream == Stream::kOut ? out_ : err_).feed(data, emit);
}

void RankOutput::on_eof(Stream stream) {
  auto emit = [&](std::string_view line) { on_line(stream, line); };
  (stream == Stream::kOut ? out_ : err_).flush(emit);
}

void RankOutput::on_line(Stream stream, std::string_view line) {
  std::string prefixed = prefix_;
  prefixed.append(line);
  if (shown_) {
    prefixed.push_back('\n');
    write_all(stream == Stream::kOut ? STDOUT_FILENO : STDERR_FILENO, prefixed);
    prefixed.pop_back();
  }
  tail_.push_back(std::move(prefixed));
  if (tail_.size() > kTailLines) tail_.pop_front();
}

}  // namespace cohortrun

// defines: MpirunOutput — Open MPI's --tag-output stream rewritten into the
// "[rank] line" form that the Gloo path writes.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>

#include "line_splitter.h"

namespace cohortrun {

// mpirun --tag-output starts every piece of a rank's output with a tag,
// "[jobid,rank]<stdout>:" (or <stderr>, <stddiag>), and repeats it after each
// newline inside the piece. A piece without a trailing newline (a partial
// line) is followed directly by the next piece's tag, possibly another
// rank's, in the middle of a line. So the text after a tag belongs to that
// rank up to the next tag or newline; text after a newline and without a tag
// is mpirun's own and is passed on unprefixed. Each rank's text is cut into
// whole lines of its own, as RankOutput does, so a partial line is joined
// with its rest and never interleaves with another rank's line. Open MPI 5
// writes a space after each tag ("...<stdout>: text"), which is the tag's.
class MpirunOutput {
 public:
  // fd: where the rewritten lines are written (the launcher's stdout or stderr).
  // space_after_tag: Open MPI 5's tags, each followed by one space.
  MpirunOutput(int fd, bool space_after_tag) : fd_(fd), space_after_tag_(space_after_tag) {}

  void feed(std::string_view data);
  // At end of stream: passes on what is left, last lines without a newline.
  void flush();

 private:
  static constexpr int kMpirun = -1;  // the "rank" of mpirun's own text

  // Hands `text` to the current rank's lines.
  void emit(std::string_view text);
  void on_line(int rank, std::string_view line);

  int fd_;
  bool space_after_tag_;
  std::string pending_;  // bytes not yet assigned: they may begin a tag
  int current_ = kMpirun;
  std::map<int, LineSplitter> lines_;  // by rank
};

}  // namespace cohortrun

// defines: LineSplitter, which cuts a byte stream into whole lines.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace cohortrun {

// Holds bytes until their newline arrives, so each line can be written in
// one piece and never interleaves with another rank's. A line longer than
// kMaxLineBytes is passed on in pieces, so a rank that never writes a
// newline cannot grow the launcher's memory without bound.
class LineSplitter {
 public:
  using LineFn = std::function<void(std::string_view line)>;
  static constexpr size_t kMaxLineBytes = 64 * 1024;

  // Calls on_line for each line completed by `data`, without its '\n'.
  void feed(std::string_view data, const LineFn& on_line);
  // At end of stream: passes on a last line that had no newline.
  void flush(const LineFn& on_line);

 private:
  std::string pending_;
};

}  // namespace cohortrun

#include "line_splitter.h"

namespace cohortrun {

void LineSplitter::feed(std::string_view data, const LineFn& on_line) {
  while (!data.empty()) {
    size_t nl = data.find('\n');
    if (nl == std::string_view::npos) {
      pending_.append(data);
      while (pending_.size() >= kMaxLineBytes) {
        on_line(std::string_view(pending_).substr(0, kMaxLineBytes));
        pending_.erase(0, kMaxLineBytes);
      }
      return;
    }
    if (pending_.empty()) {
      on_line(data.substr(0, nl));  // common case: no copy
    } else {
      pending_.append(data.substr(0, nl));
      on_line(pending_);
      pending_.clear();
    }
    data.remove_prefix(nl + 1);
  }
}

void LineSplitter::flush(const LineFn& on_line) {
  if (pending_.empty()) return;
  on_line(pending_);
  pending_.clear();
}

}  // namespace cohortrun

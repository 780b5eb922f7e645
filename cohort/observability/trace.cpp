#include "cohort/observability/trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <system_error>

#include "cohort/core/error.h"
#include "cohort/core/types.h"

namespace cohort {
namespace {

// A fresh file beside `target` (same folder, so that the final rename stays
// on one filesystem), creating the folder. mkostemp opens with O_EXCL under
// a random name, so a file or symlink planted in advance is never opened or
// followed. Returns the descriptor and the name; throws naming the path.
std::pair<int, std::string> create_aside(const std::string& target, int rank) {
  const std::filesystem::path path(target);
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::string name = (dir / ("." + path.filename().string() + ".XXXXXX")).string();
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    throw Error("cohort: rank " + std::to_string(rank) + ": cannot write the trace " + target +
                ": " + (ec ? ec.message() : std::string(std::strerror(errno))));
  }
  return {fd, name};
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t k = ::write(fd, text.data() + done, text.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw std::system_error(errno, std::generic_category());
    done += static_cast<size_t>(k);
  }
}

int64_t ns_of(Tracer::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A small number per thread, stable for the thread's life: the trace's tid.
int thread_lane() {
  static std::atomic<int> next{1};
  thread_local const int lane = next.fetch_add(1, std::memory_order_relaxed);
  return lane;
}

void write_string(std::ostream& os, const std::string& s) {
  os << '"';
  for (char c : s) {
    switch (c) {
      case '"':
        os << "\\\"";
        break;
      case '\\':
        os << "\\\\";
        break;
      case '\n':
        os << "\\n";
        break;
      case '\t':
        os << "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          os << buf;
        } else {
          os << c;
        }
    }
  }
  os << '"';
}

// Microseconds with nanosecond digits, exactly (no rounding through double).
void write_us(std::ostream& os, int64_t ns) {
  if (ns < 0) {
    os << '-';
    ns = -ns;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  os << buf;
}

// JSON has no NaN or infinity: such a value (a caller's diverged loss) is
// null, else the whole file would not parse.
void write_number(std::ostream& os, double v) {
  if (!std::isfinite(v)) {
    os << "null";
    return;
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  os << buf;
}

// Writes `text` aside and renames it onto `path`: a reader never sees half
// a file, and rename() replaces whatever is at path (a symlink included)
// without following it. std::system_error on failure, nothing left aside.
void replace_file(const std::string& path, int rank, const std::string& text) {
  auto [fd, tmp] = create_aside(path, rank);
  try {
    // mkostemp made it 0600; a trace is read by whoever merges the timelines.
    ::fchmod(fd, 0644);
    write_all(fd, text);
    if (::close(fd) != 0) throw std::system_error(errno, std::generic_category());
    fd = -1;
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      throw std::system_error(errno, std::generic_category());
    }
  } catch (const std::system_error&) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
}

}  // namespace

Tracer::Tracer(int rank, int world_size, std::string path, size_t max_events)
    : rank_(rank),
      world_size_(world_size),
      path_(std::move(path)),
      max_events_(max_events > 0 ? max_events : kDefaultTraceMaxEvents) {
  // Found now, not at exit after the whole run: the folder must take a file.
  auto [fd, name] = create_aside(path_, rank_);
  ::close(fd);
  ::unlink(name.c_str());
}

Tracer::~Tracer() {
  try {
    flush();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort: rank %d: the trace was not written: %s\n", rank_, e.what());
  }
}

void Tracer::add(Event e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= max_events_) {
    // Full: the memory stays bounded; flush() says how many were left out.
    if (dropped_++ == 0) first_dropped_ns_ = e.ts_ns;
    return;
  }
  events_.push_back(std::move(e));
}

void Tracer::complete(std::string name, const char* category, Clock::time_point start,
                      Clock::time_point end, std::vector<TraceArg> args) {
  add({'X', std::move(name), category, ns_of(start), ns_of(end) - ns_of(start), 0, thread_lane(),
       std::move(args)});
}

void Tracer::instant(std::string name, const char* category, Clock::time_point at,
                     std::vector<TraceArg> args) {
  add({'i', std::move(name), category, ns_of(at), 0, 0, thread_lane(), std::move(args)});
}

void Tracer::async_span(std::string name, const char* category, uint64_t id,
                        Clock::time_point start, Clock::time_point end,
                        std::vector<TraceArg> args) {
  // One record; flush() writes it as the "b" and "e" pair.
  add({'b', std::move(name), category, ns_of(start), ns_of(end) - ns_of(start), id, thread_lane(),
       std::move(args)});
}

void Tracer::set_clock_offset(double offset_us, double round_trip_us) {
  std::lock_guard<std::mutex> lock(mu_);
  offset_us_ = offset_us;
  round_trip_us_ = round_trip_us;
}

size_t Tracer::event_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

size_t Tracer::dropped_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

void Tracer::write_event(std::ostream& os, const Event& e, int pid) {
  auto head = [&](char phase, int64_t ts) {
    os << ",\n{\"ph\":\"" << phase << "\",\"name\":";
    write_string(os, e.name);
    os << ",\"cat\":\"" << e.category << "\",\"pid\":" << pid << ",\"tid\":" << e.tid << ",\"ts\":";
    write_us(os, ts);
  };
  auto args = [&] {
    os << ",\"args\":{";
    for (size_t i = 0; i < e.args.size(); ++i) {
      if (i) os << ',';
      write_string(os, e.args[i].key);
      os << ':';
      if (e.args[i].is_number) {
        write_number(os, e.args[i].number);
      } else {
        write_string(os, e.args[i].text);
      }
    }
    os << '}';
  };
  if (e.phase == 'b') {
    head('b', e.ts_ns);
    os << ",\"id\":" << e.id;
    args();
    os << '}';
    head('e', e.ts_ns + e.dur_ns);
    os << ",\"id\":" << e.id << '}';
  } else {
    head(e.phase, e.ts_ns);
    if (e.phase == 'X') {
      os << ",\"dur\":";
      write_us(os, e.dur_ns);
    } else {
      os << ",\"s\":\"t\"";
    }
    args();
    os << '}';
  }
}

void Tracer::flush() {
  std::ostringstream os;
  {
    std::lock_guard<std::mutex> lock(mu_);
    os << "{\"traceEvents\":[\n";
    os << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << rank_
       << ",\"tid\":0,\"args\":{\"name\":\"rank " << rank_ << "\"}},\n";
    os << "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" << rank_
       << ",\"tid\":0,\"args\":{\"sort_index\":" << rank_ << "}}";
    for (const auto& e : events_) write_event(os, e, rank_);
    if (dropped_ > 0) {
      // One process-wide mark where the trace stops being complete; the
      // summary reads its count.
      os << ",\n{\"ph\":\"i\",\"name\":\"dropped events\",\"cat\":\"trace\",\"pid\":" << rank_
         << ",\"tid\":0,\"ts\":";
      write_us(os, first_dropped_ns_);
      os << ",\"s\":\"p\",\"args\":{\"dropped\":" << dropped_ << ",\"max_events\":" << max_events_
         << "}}";
    }
    os << "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"cohort_trace\":1,\"rank\":" << rank_
       << ",\"world_size\":" << world_size_ << ",\"dropped_events\":" << dropped_
       << ",\"max_events\":" << max_events_ << ",\"clock_offset_us\":";
    write_number(os, offset_us_);
    os << ",\"clock_round_trip_us\":";
    write_number(os, round_trip_us_);
    os << "}}\n";
  }
  try {
    replace_file(path_, rank_, os.str());
  } catch (const std::system_error& e) {
    throw Error("cohort: rank " + std::to_string(rank_) + ": cannot write the trace " + path_ +
                ": " + e.code().message());
  }
}

}  // namespace cohort

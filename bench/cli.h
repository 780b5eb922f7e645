// defines: what the benchmark drivers' command lines (CLI11) share:
//   show_defaults   --help lists every option with its default
//   positive, non_negative  an integer option's lower bound, with a short
//                   message (CLI::PositiveNumber's names its bounds as
//                   doubles of hundreds of digits)
//   add_loop_flags  --batch, --steps, --warmup of the drivers that time a
//                   training loop (ddp_vs_torch, compression_bench,
//                   zero_memory, fsdp_bench), with each driver's defaults
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace cohort::bench {

inline void show_defaults(CLI::App& app) { app.option_defaults()->always_capture_default(); }

// An integer of at least `min`; `name` is what --help shows.
inline CLI::Validator at_least(long long min, const std::string& name) {
  return CLI::Validator(
      [min](std::string& text) {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        if (text.empty() || *end != '\0' || errno == ERANGE) {
          return "'" + text + "' is not an integer";
        }
        if (v < min) return "must be at least " + std::to_string(min) + " (got " + text + ")";
        return std::string();
      },
      name);
}

inline CLI::Validator positive() { return at_least(1, "POSITIVE"); }
inline CLI::Validator non_negative() { return at_least(0, "NONNEGATIVE"); }

inline void add_loop_flags(CLI::App& app, int64_t& batch, int& steps, int& warmup) {
  app.add_option("--batch", batch, "samples per rank and step")->check(positive());
  app.add_option("--steps", steps, "timed steps")->check(positive());
  app.add_option("--warmup", warmup, "untimed steps first")->check(non_negative());
}

}  // namespace cohort::bench

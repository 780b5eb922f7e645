// The command line of the short training examples (ddp, zero,
// tensor_parallel): how many optimizer steps, and where the checkpoint goes.
#pragma once

#include <CLI/CLI.hpp>
#include <limits>
#include <optional>
#include <string>

namespace cohort_examples {

struct TrainArgs {
  int steps = 20;
  std::string checkpoint_dir;
};

/// Parses `--steps` and `--checkpoint-dir` into `args` (its values are the
/// defaults). Returns the exit code when the program should stop instead
/// (after --help, or on a bad option, which CLI11 has reported).
inline std::optional<int> parse_train_args(int argc, char** argv, const std::string& about,
                                           TrainArgs& args) {
  CLI::App app{about};
  app.option_defaults()->always_capture_default();
  app.add_option("--steps", args.steps, "optimizer steps")
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  app.add_option("--checkpoint-dir", args.checkpoint_dir, "where the checkpoint goes");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

}  // namespace cohort_examples

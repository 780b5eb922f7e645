// cohort-ckpt: a distributed checkpoint folder (cohort/dcp).
//   cohort-ckpt inspect DIR [--verify]   tensors, shapes, layout, checksums
//   cohort-ckpt consolidate DIR OUT      the model, whole, for torch::load
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "ckpt_files.h"

int main(int argc, char** argv) {
  CLI::App app{"Inspects and consolidates cohort distributed checkpoints."};
  app.require_subcommand(1);
  std::string dir, out, prefix = "model.";
  bool verify = false;
  auto* inspect = app.add_subcommand("inspect", "list tensors, shapes, layout and checksums");
  inspect->add_option("dir", dir, "the checkpoint folder")->required();
  inspect->add_flag("--verify", verify, "also read every chunk and check its checksums");
  auto* consolidate = app.add_subcommand(
      "consolidate", "write the whole model as one file that torch::load(module, OUT) reads");
  consolidate->add_option("dir", dir, "the checkpoint folder")->required();
  consolidate->add_option("out", out, "the file to write")->required();
  consolidate->add_option("--prefix", prefix, "the tensors to write (default: model.)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (inspect->parsed()) {
      std::fputs(cohort_ckpt::inspect_checkpoint(dir, verify).c_str(), stdout);
    } else {
      const int n = cohort_ckpt::consolidate_checkpoint(dir, out, prefix);
      std::printf("cohort-ckpt: %d tensors -> %s\n", n, out.c_str());
    }
    return 0;
  } catch (const c10::Error& e) {
    // LibTorch's own: its message without the backtrace of cohort's frames.
    std::fprintf(stderr, "cohort-ckpt: %s: %s\n", dir.c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort-ckpt: %s\n", e.what());
    return 1;
  }
}

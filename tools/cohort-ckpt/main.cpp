// cohort-ckpt: a distributed checkpoint folder (cohort/dcp).
//   cohort-ckpt inspect DIR [--verify]   tensors, shapes, layout, checksums
//   cohort-ckpt consolidate DIR OUT      the model, whole, for torch::load
//   cohort-ckpt export DIR OUT --format safetensors|torch [--shard-size BYTES]
//                                        the model for Python (Hugging Face, torch.load)
//   cohort-ckpt import FILE DIR          a safetensors or torch.save file as a checkpoint
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "ckpt_files.h"

int main(int argc, char** argv) {
  CLI::App app{"Inspects, consolidates, exports and imports cohort distributed checkpoints."};
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
  cohort_ckpt::ExportOptions ex;
  auto* exp = app.add_subcommand(
      "export", "write the model's tensors as safetensors or as a torch.save dict for Python");
  exp->add_option("dir", dir, "the checkpoint folder")->required();
  exp->add_option("out", out, "the file to write (model.safetensors, model.pt)")->required();
  exp->add_option("--format", ex.format, "safetensors (default) or torch")
      ->check(CLI::IsMember({"safetensors", "torch"}));
  exp->add_option("--prefix", ex.prefix,
                  "the tensors to write (default: model.), named without it");
  exp->add_option("--shard-size", ex.max_shard_bytes,
                  "safetensors: shards of at most this many bytes and an index when larger "
                  "(default 0: one file)");
  std::string file;
  auto* imp = app.add_subcommand(
      "import", "write a safetensors file (or index) or torch.save dict as a checkpoint folder");
  imp->add_option("file", file, "the safetensors file, index.json or torch.save file")->required();
  imp->add_option("dir", dir, "the checkpoint folder to write")->required();
  imp->add_option("--prefix", prefix, "prepended to each name (default: model.)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (inspect->parsed()) {
      std::fputs(cohort_ckpt::inspect_checkpoint(dir, verify).c_str(), stdout);
    } else if (consolidate->parsed()) {
      const int n = cohort_ckpt::consolidate_checkpoint(dir, out, prefix);
      std::printf("cohort-ckpt: %d tensors -> %s\n", n, out.c_str());
    } else if (exp->parsed()) {
      for (const auto& f : cohort_ckpt::export_checkpoint(dir, out, ex)) {
        std::printf("cohort-ckpt: wrote %s\n", f.c_str());
      }
    } else {
      const int n = cohort_ckpt::import_weights(file, dir, prefix);
      std::printf("cohort-ckpt: %d tensors -> %s\n", n, dir.c_str());
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

// fashion_mnist: the main job. A CNN on Fashion-MNIST with DDP and
// cohort::Trainer, on as many ranks as cohortrun starts:
//
//   cohortrun -n 2 -- fashion_mnist --epochs 2
//   cohortrun -n 2 -- fashion_mnist --epochs 2 --fsdp   # fully sharded
//   cohortrun -n 2 -- fashion_mnist --device cuda       # on the GPU
//
// --fsdp trains the same network (as a Sequential, each layer with weights
// a fully_shard unit) through TrainerWiring::fsdp: each rank holds 1/N of
// the weights, gradients and AdamW state. Checkpoints are distributed (dcp)
// in both modes, so they resume at any number of ranks.
// Each rank reads Debian's dataset files, trains on its shard of every
// global batch, and evaluates its slice of the test set; the correct counts
// are summed over ranks. Rank 0 writes the metrics and draws the curves.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "dataset.h"
#include "net.h"
#include "plot_metrics.h"

namespace {

struct Flags {
  int64_t epochs = 2;
  std::string data = fashion_mnist::kDebianDataDir;
  int64_t batch_size = 128;  // global: over all ranks and micro-batches
  int64_t accumulation = 1;
  double lr = 1e-3;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::string metrics = "metrics.jsonl";
  std::string plot = "curves.png";
  int64_t steps = 0;  // 0: train all epochs
  uint64_t seed = 0;
  std::string compression = "none";  // cohort/compression: none fp16 bf16 int8 topk powersgd
  int powersgd_rank = 2;
  double powersgd_min_compression_rate = 2;  // PyTorch's default
  int64_t compression_start = 100;           // PowerSGD: uncompressed steps first
  bool fsdp = false;                         // fully_shard instead of DDP
  std::string device = "cpu";  // the model's; the data stay on the host, a batch at a time moves
};

using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

// "cuda" without an index: the GPU of this rank's cohort::local_rank()
// (cohortrun, torchrun, mpirun or srun say it), so the ranks of a node
// spread over its GPUs (sharing them in turn when there are fewer).
torch::Device pick_device(const std::string& name) {
  torch::Device device(name);
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (device.is_cuda() && !device.has_index() && gpus > 0) {
    device =
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cohort::local_rank() % gpus));
  }
  return device;
}

// Accuracy on the test set, each rank scoring a disjoint contiguous slice.
double test_accuracy(const Forward& forward, torch::nn::Module& net,
                     const fashion_mnist::Split& test, cohort::Communicator& comm,
                     torch::Device device) {
  torch::NoGradGuard no_grad;
  net.eval();
  const int64_t n = test.images.size(0);
  const int64_t begin = n * comm.rank() / comm.size();
  const int64_t end = n * (comm.rank() + 1) / comm.size();
  int64_t correct = 0;
  for (int64_t i = begin; i < end; i += 1000) {
    const int64_t len = std::min<int64_t>(1000, end - i);
    auto pred = forward(test.images.narrow(0, i, len).to(device)).argmax(1);
    correct += pred.eq(test.labels.narrow(0, i, len).to(device)).sum().item<int64_t>();
  }
  net.train();
  auto counts = torch::tensor({correct, end - begin}, torch::kInt64);
  comm.all_reduce(counts, {cohort::ReduceOp::Sum}).wait();
  return static_cast<double>(counts[0].item<int64_t>()) /
         static_cast<double>(counts[1].item<int64_t>());
}

int run(const Flags& flags) {
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) setenv("OPENBLAS_NUM_THREADS", "1", 0);
  auto world = cohort::init();
  // One dimension of data parallelism: DDP's replicas or FSDP's shards.
  auto mesh = cohort::init_device_mesh(world, {world->size()}, {"dp"});
  const auto& comm = mesh.process_group();
  // Ranks share the machine's cores: split them instead of oversubscribing.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  torch::set_num_threads(static_cast<int>(std::max<unsigned>(1, cores / comm->size())));
  const bool lead = comm->rank() == 0;
  const int64_t per_rank = flags.batch_size / (comm->size() * flags.accumulation);
  if (per_rank < 1 || per_rank * comm->size() * flags.accumulation != flags.batch_size) {
    throw cohort::InvalidArgument(
        "fashion_mnist: --batch-size " + std::to_string(flags.batch_size) +
        " does not split evenly over " + std::to_string(comm->size()) + " ranks x " +
        std::to_string(flags.accumulation) + " micro-batches");
  }
  const auto train = fashion_mnist::load_split(flags.data, "train");
  const auto test = fashion_mnist::load_split(flags.data, "t10k");

  if (flags.fsdp && flags.compression != "none") {
    throw cohort::InvalidArgument("fashion_mnist: --compression is DDP's; not with --fsdp");
  }

  const torch::Device device = pick_device(flags.device);
  torch::manual_seed(flags.seed);
  // The model as the loss and the evaluation call it, the module whose mode
  // they set, the optimizer and the wiring: DDP's or FSDP's.
  Forward forward;
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<cohort::DistributedDataParallel<fashion_mnist::Net>> ddp;
  std::unique_ptr<torch::optim::AdamW> adamw;
  std::optional<cohort::TrainerWiring> wiring;
  if (flags.fsdp) {
    auto net = fashion_mnist::make_sequential_net();
    net->to(device);  // before sharding: each shard lives on its parameter's device
    auto sharded = cohort::fully_shard(cohort::shard_blocks(net, mesh), mesh);
    adamw = std::make_unique<torch::optim::AdamW>(sharded->parameters(),
                                                  torch::optim::AdamWOptions(flags.lr));
    wiring.emplace(cohort::TrainerWiring::fsdp(sharded, *adamw));
    forward = [sharded](const torch::Tensor& x) mutable { return sharded->forward(x); };
    module = sharded.ptr();
  } else {
    fashion_mnist::Net net;
    net->to(device);
    cohort::DDPOptions ddp_options;
    ddp_options.compression.kind = cohort::compression::parse_compression_kind(flags.compression);
    ddp_options.compression.powersgd_rank = flags.powersgd_rank;
    ddp_options.compression.powersgd_min_compression_rate = flags.powersgd_min_compression_rate;
    ddp_options.compression.powersgd_start_iteration = flags.compression_start;
    ddp = std::make_unique<cohort::DistributedDataParallel<fashion_mnist::Net>>(net, mesh,
                                                                                ddp_options);
    adamw = std::make_unique<torch::optim::AdamW>(net->parameters(),
                                                  torch::optim::AdamWOptions(flags.lr));
    wiring.emplace(cohort::TrainerWiring::ddp(*ddp, *adamw));
    forward = [&ddp](const torch::Tensor& x) { return ddp->forward(x); };
    module = net.ptr();
  }

  cohort::TrainerOptions config;
  config.accumulation_steps = flags.accumulation;
  config.schedule.base_lr = flags.lr;
  config.epochs = flags.epochs;
  config.max_steps = flags.steps;
  config.checkpoint_dir = flags.checkpoint_dir;
  config.checkpoint_every = flags.checkpoint_every;
  config.metrics_path = flags.metrics;
  cohort::Trainer trainer(
      std::move(*wiring),
      [&](const torch::data::Example<>& b) {
        return torch::nn::functional::cross_entropy(forward(b.data.to(device)),
                                                    b.target.to(device));
      },
      config);
  cohort::TensorDataSource source(train.images, train.labels, per_rank, comm->rank(), comm->size());
  if (auto step = trainer.resume(); step && lead) {
    std::printf("resumed from checkpoint at step %lld\n", static_cast<long long>(*step));
  }
  if (lead) {
    std::printf(
        "fashion_mnist: %d ranks, %s, global batch %lld (%lld per rank x %lld), %lld epochs, "
        "compression %s\n",
        comm->size(), flags.fsdp ? "FSDP" : "DDP", static_cast<long long>(flags.batch_size),
        static_cast<long long>(per_rank), static_cast<long long>(flags.accumulation),
        static_cast<long long>(flags.epochs), flags.compression.c_str());
  }

  double accuracy = -1;
  int64_t evaluated_at = -1;
  cohort::FitCallbacks callbacks;
  callbacks.on_epoch_end = [&](const cohort::EpochEnd& e) {
    accuracy = test_accuracy(forward, *module, test, *comm, device);
    evaluated_at = e.step;
    trainer.log_eval({{"test_accuracy", accuracy}, {"epoch_seconds", e.seconds}});
    if (lead) {
      std::printf("epoch %lld: %.1f s, test accuracy %.4f\n", static_cast<long long>(e.epoch + 1),
                  e.seconds, accuracy);
      std::fflush(stdout);
    }
  };
  const auto steps = trainer.fit(source, callbacks);
  if (evaluated_at != trainer.position().step) {  // stopped mid-epoch (--steps)
    accuracy = test_accuracy(forward, *module, test, *comm, device);
    trainer.log_eval({{"test_accuracy", accuracy}});
  }
  if (lead) {
    if (!steps.empty()) std::printf("final loss: %.6f\n", steps.back().loss);
    std::printf("test accuracy: %.4f\n", accuracy);
    if (!flags.plot.empty() && !flags.metrics.empty()) {
      try {
        cohort_plot::plot_metrics(cohort_plot::read_metrics(flags.metrics), flags.plot);
        std::printf("curves: %s\n", flags.plot.c_str());
      } catch (const cohort_plot::PlotError& e) {
        // The training result stands; only the picture is missing.
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
    std::fflush(stdout);
  }
  cohort::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST CNN with cohort DDP or FSDP and Trainer (run it with cohortrun)."};
  Flags f;
  app.add_option("--epochs", f.epochs, "epochs to train")->check(CLI::PositiveNumber);
  app.add_option("--data", f.data, "folder with the gzip IDX files");
  app.add_option("--batch-size", f.batch_size, "global batch size (all ranks together)")
      ->check(CLI::PositiveNumber);
  app.add_option("--accumulation", f.accumulation, "micro-batches per optimizer step")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "AdamW learning rate");
  app.add_option("--checkpoint-dir", f.checkpoint_dir, "checkpoint folder (resume from it)");
  app.add_option("--checkpoint-every", f.checkpoint_every, "steps between checkpoints");
  app.add_option("--metrics", f.metrics, "JSON-lines metrics file (rank 0)");
  app.add_option("--plot", f.plot, "PNG of the curves (empty: none)");
  app.add_option("--steps", f.steps, "stop after this many optimizer steps (0: all --epochs)");
  app.add_option("--seed", f.seed, "seed of the initial weights");
  app.add_option("--compression", f.compression,
                 "gradient compression: none, fp16, bf16, int8, topk, powersgd");
  app.add_option("--powersgd-rank", f.powersgd_rank, "PowerSGD's rank")->check(CLI::PositiveNumber);
  app.add_option("--powersgd-min-compression-rate", f.powersgd_min_compression_rate,
                 "PowerSGD: compress a matrix only when it shrinks at least this many times")
      ->check(CLI::PositiveNumber);
  app.add_option("--compression-start", f.compression_start,
                 "PowerSGD: steps averaged uncompressed before compression starts");
  app.add_flag("--fsdp", f.fsdp, "fully sharded data parallelism (fully_shard) instead of DDP");
  app.add_option("--device", f.device, "where the model trains: cpu, cuda or cuda:N");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
}

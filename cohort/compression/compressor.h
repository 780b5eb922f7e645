// defines: CompressionKind, CompressionOptions, Compressor (a stateful
// gradient compressor: averages a tensor over a communicator sending fewer
// bytes), make_compressor, compressed_all_reduce.
//
// What each kind sends per rank and step (p ranks, n float32 elements):
//   None      the engine's all_reduce (a ring: 2 (p-1)/p * 4n bytes)
//   Fp16/Bf16 16-bit ring over point-to-point: 2 (p-1)/p * 2n
//   Int8      int8 chunks and per-chunk scales, two phases: ~2 (p-1)/p * n
//   TopK      all-gather of k = ratio * n (int32 index, float32 value)
//             pairs: (p-1) * 8k
//   PowerSGD  all-reduce of P (rows x rank) and Q (cols x rank) per matrix;
//             vectors and matrices that compress too little go uncompressed
// Int8, TopK and PowerSGD keep error feedback (what was not applied this
// step is added to the next step's input), held per tensor key; state()
// and load_state() carry it, and PowerSGD's Q and step counters, through a
// checkpoint.
//
// Before the first collective on a key (and again when the key's size or
// shapes change), every compressor all-gathers the hash of a fingerprint of
// its kind, the settings its kind uses and the tensor's layout, and refuses
// on every rank, with a MismatchError, to go on when the ranks differ:
// compressors that disagree would otherwise exchange messages of different
// sizes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cohort {

class Communicator;

namespace compression {

/// Which compressor.
enum class CompressionKind { None, Fp16, Bf16, Int8, TopK, PowerSGD };

/// "none", "fp16", "bf16", "int8", "topk", "powersgd".
std::string to_string(CompressionKind kind);
/// The inverse of to_string; throws InvalidArgument naming the choices.
CompressionKind parse_compression_kind(const std::string& name);

/// How a compressor is built (fields not used by its kind are ignored).
struct CompressionOptions {
  /// Which compressor; None keeps the plain all-reduce.
  CompressionKind kind = CompressionKind::None;
  /// Int8, TopK, PowerSGD: carry what was dropped into the next step.
  bool error_feedback = true;
  /// Int8: elements per float32 scale.
  int64_t int8_chunk = 2048;
  /// TopK: share of the elements sent (at least one element per tensor).
  double topk_ratio = 0.01;
  /// PowerSGD: rank of the approximation (matrix_approximation_rank).
  int powersgd_rank = 1;
  /// PowerSGD: steps of each tensor averaged uncompressed before
  /// compression starts (start_powerSGD_iter).
  int64_t powersgd_start_iteration = 1000;
  /// PowerSGD: a matrix rows x cols is compressed only when
  /// (rows + cols) * rank * min_compression_rate < rows * cols.
  double powersgd_min_compression_rate = 2;
  /// PowerSGD: start each step's power iteration from the last step's Q.
  bool powersgd_warm_start = true;
  /// PowerSGD: seed of the random initial Q (the same on every rank).
  int64_t powersgd_seed = 0;
};

/// The elements [offset, offset + count) of a flat tensor.
struct ElementRange {
  int64_t offset = 0;  ///< the first element
  int64_t count = 0;   ///< how many elements
};

/// A gradient compressor. Not thread-safe; one per communicator.
class Compressor {
 public:
  virtual ~Compressor() = default;
  /// Averages the flat float32 `flat` over the ranks of `comm` in place.
  /// `key` names the tensor across steps (its error feedback and PowerSGD
  /// state); every rank passes the same keys in the same order. `shaped`
  /// optionally gives views of `flat` shaped as the parameters it holds
  /// (PowerSGD compresses matrices; without them `flat` is one vector). The
  /// views must not overlap (InvalidArgument on every rank); elements in no
  /// view are averaged uncompressed. Collective; blocking.
  virtual void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                          const std::vector<at::Tensor>& shaped = {}) = 0;
  /// The kind's name (to_string).
  virtual std::string name() const = 0;
  /// The state a resumed run needs, as named tensors (copies).
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  /// Restores state() of an earlier run (same world size and keys).
  virtual void load_state(const std::map<std::string, at::Tensor>& state) { (void)state; }
  /// Forgets what is kept for `key` (error feedback, PowerSGD's Q; its step
  /// counter stays) and the layout agreed for it: the tensor under `key` now
  /// holds other values (DDP rebuilt the bucket). Call it on every rank.
  void reset(int64_t key);
  /// Copies this rank's error feedback of `ranges` of the tensor under `key`
  /// (replacing what was held for the key), before its all_reduce: DDP holds
  /// the parameters this rank did not use in the step.
  void hold(const Communicator& comm, int64_t key, const std::vector<ElementRange>& ranges);
  /// Puts back what hold() copied of `ranges` (some of the held ones), after
  /// the all_reduce: DDP drops the step's result for a parameter no rank
  /// used, so the error the step sent for it must stay for a later step.
  /// State that did not exist at hold() is zeroed.
  void put_back(const Communicator& comm, int64_t key, const std::vector<ElementRange>& ranges);

 protected:
  /// Checks that every rank of `comm` uses the settings of `options` that
  /// its kind reads and a tensor of `numel` elements whose layout words
  /// (shapes, for PowerSGD) hash alike: one all-gather of a fingerprint's
  /// hash the first time a key is seen, or when its local layout changed.
  /// Throws MismatchError on every rank otherwise. Collective.
  void agree(Communicator& comm, const CompressionOptions& options, int64_t key, int64_t numel,
             const std::vector<int64_t>& layout = {});
  /// Drops the state kept for `key` (reset()); the default keeps none.
  virtual void forget(int64_t key) { (void)key; }
  /// Views of the error feedback this rank keeps for the elements `range` of
  /// the tensor under `key`, the same ones for the same range while its
  /// state exists; empty while it has none. The default keeps none.
  virtual std::vector<at::Tensor> element_state(int64_t key, const ElementRange& range, int rank,
                                                int size) {
    (void)key, (void)range, (void)rank, (void)size;
    return {};
  }

 private:
  struct Held {
    ElementRange range;
    std::vector<at::Tensor> copies;  // empty: no state when held
  };
  std::map<int64_t, std::vector<int64_t>> agreed_;  // key -> the fingerprint agreed on
  std::map<int64_t, std::vector<Held>> held_;
};

/// A compressor of options.kind; throws InvalidArgument on bad options.
std::unique_ptr<Compressor> make_compressor(const CompressionOptions& options);

/// Averages `tensor` (float32, contiguous, any shape) over `comm` in place
/// with `compressor`, for users who reduce by hand. Collective; blocking.
void compressed_all_reduce(Communicator& comm, at::Tensor& tensor, Compressor& compressor,
                           int64_t key = 0);

}  // namespace compression
}  // namespace cohort

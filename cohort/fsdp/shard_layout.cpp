#include "cohort/fsdp/shard_layout.h"

#include <algorithm>
#include <utility>

namespace cohort::fsdp {

ShardLayout make_shard_layout(const std::vector<torch::Tensor>& params, int world, int rank) {
  ShardLayout layout;
  layout.world = world;
  layout.rank = rank;
  for (const auto& t : params) {
    ParamShard p;
    p.full_sizes = t.sizes().vec();
    p.rows = t.dim() == 0 ? 1 : t.size(0);
    p.row_numel = p.rows == 0 ? 0 : t.numel() / p.rows;
    if (t.dim() > 0 && p.rows == 0) {
      // No rows: the row size is still what the other dims say.
      p.row_numel = 1;
      for (int64_t d = 1; d < t.dim(); ++d) p.row_numel *= t.size(d);
    }
    p.chunk_rows = (p.rows + world - 1) / world;
    p.local_rows = std::clamp<int64_t>(p.rows - rank * p.chunk_rows, 0, p.chunk_rows);
    p.shard_sizes = t.dim() == 0 ? std::vector<int64_t>{p.local_rows} : p.full_sizes;
    if (t.dim() > 0) p.shard_sizes[0] = p.local_rows;
    p.shard_offset = layout.shard_numel;
    p.full_offset = layout.full_numel;
    layout.shard_numel += p.chunk_rows * p.row_numel;
    layout.full_numel += t.numel();
    layout.params.push_back(std::move(p));
  }
  return layout;
}

namespace {

// Parameter p's padded chunk in every rank's segment of a rank-major
// buffer: [world, chunk_rows, row_numel] (a view).
torch::Tensor rank_chunks(const ShardLayout& layout, const ParamShard& p,
                          const torch::Tensor& flat) {
  return flat.view({layout.world, layout.shard_numel})
      .narrow(1, p.shard_offset, p.chunk_rows * p.row_numel)
      .view({layout.world, p.chunk_rows, p.row_numel});
}

// Rank r's rows of the full parameter: [lo, lo + n), n <= chunk_rows.
std::pair<int64_t, int64_t> rank_rows(const ParamShard& p, int r) {
  const int64_t lo = std::min<int64_t>(r * p.chunk_rows, p.rows);
  return {lo, std::min<int64_t>(p.chunk_rows, p.rows - lo)};
}

}  // namespace

void copy_out(const ShardLayout& layout, const torch::Tensor& gathered,
              const std::vector<torch::Tensor>& full) {
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const auto& p = layout.params[i];
    if (p.rows * p.row_numel == 0) continue;
    auto chunks = rank_chunks(layout, p, gathered);
    auto dst = full[i].view({p.rows, p.row_numel});
    if (layout.world * p.chunk_rows == p.rows) {
      dst.view({layout.world, p.chunk_rows, p.row_numel}).copy_(chunks);
      continue;
    }
    for (int r = 0; r < layout.world; ++r) {
      const auto [lo, n] = rank_rows(p, r);
      if (n > 0) dst.narrow(0, lo, n).copy_(chunks[r].narrow(0, 0, n));
    }
  }
}

void copy_in(const ShardLayout& layout, const std::vector<torch::Tensor>& grads,
             torch::Tensor& flat) {
  for (size_t i = 0; i < layout.params.size(); ++i) copy_in_param(layout, i, grads[i], flat);
}

void copy_in_param(const ShardLayout& layout, size_t i, const torch::Tensor& grad,
                   torch::Tensor& flat) {
  const auto& p = layout.params[i];
  if (p.chunk_rows * p.row_numel == 0) return;
  auto chunks = rank_chunks(layout, p, flat);
  if (!grad.defined()) {
    chunks.zero_();
    return;
  }
  auto src = grad.reshape({p.rows, p.row_numel});
  if (layout.world * p.chunk_rows == p.rows) {
    chunks.copy_(src.view({layout.world, p.chunk_rows, p.row_numel}));
    return;
  }
  // The last ranks' chunks run past the rows: their padding is zero.
  for (int r = 0; r < layout.world; ++r) {
    const auto [lo, n] = rank_rows(p, r);
    if (n > 0) chunks[r].narrow(0, 0, n).copy_(src.narrow(0, lo, n));
    if (n < p.chunk_rows) chunks[r].narrow(0, n, p.chunk_rows - n).zero_();
  }
}

void copy_local_rows(const ParamShard& p, int rank, const torch::Tensor& full,
                     torch::Tensor& shard_flat) {
  auto dst = shard_flat.narrow(0, p.shard_offset, p.chunk_rows * p.row_numel)
                 .view({p.chunk_rows, p.row_numel});
  dst.zero_();
  if (p.local_rows > 0) {
    dst.narrow(0, 0, p.local_rows)
        .copy_(full.reshape({p.rows, p.row_numel}).narrow(0, rank * p.chunk_rows, p.local_rows));
  }
}

}  // namespace cohort::fsdp

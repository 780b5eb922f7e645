// cohort: distributed training for the LibTorch C++ frontend.
// defines (through its includes): the whole public API: init, Communicator,
// Work, the options and error kinds, the stores, the algorithm choice,
// DistributedDataParallel, ZeroRedundancyOptimizer, FusedDistributedOptimizer,
// activation checkpointing, the pipeline schedules and runtime, the device
// mesh, the tensor-parallel layers and the 3-D gradient synchronizer, ring
// attention over a context-parallel group, the expert-parallel MoE layer,
// the Trainer with its optimizers, gradient syncs and data sources, and the
// version macros.
#pragma once

// Communication.
#include "cohort/comm/communicator.h"
#include "cohort/comm/init.h"
#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/compressor.h"
#include "cohort/core/algorithm.h"
#include "cohort/core/error.h"
#include "cohort/core/store/hash_store.h"
#include "cohort/core/store/prefix_store.h"
#include "cohort/core/store/tcp_store.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"
#include "cohort/data/distributed_sampler.h"
#include "cohort/data/seed.h"
#include "cohort/memory/memory_scope.h"
#include "cohort/observability/trace.h"
// Activation checkpointing.
#include "cohort/activation/checkpoint.h"
#include "cohort/activation/checkpoint_wrapper.h"
// Data parallelism and optimizers.
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/grad_sync/average_gradients.h"
#include "cohort/grad_sync/canonical_norm.h"
#include "cohort/grad_sync/gradient_presence.h"
#include "cohort/grad_sync/parameter_check.h"
#include "cohort/optim/fused_adamw.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
// Pipeline, tensor and 3-D parallelism.
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/mesh/mesh_sampler.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/pipeline/schedule_memory.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "cohort/tensor_parallel/random.h"
// Context parallelism.
#include "cohort/context_parallel/layout.h"
#include "cohort/context_parallel/ring_attention.h"
#include "cohort/context_parallel/sequence_loss.h"
// Expert parallelism.
#include "cohort/expert_parallel/moe.h"
// Distributed checkpoints.
#include "cohort/dcp/async_save.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/metadata.h"
#include "cohort/dcp/safetensors.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/dcp/torch_file.h"
#include "cohort/dcp/weights_file.h"
// Training loop: the Trainer, the plan it takes, each mode's parts of a
// plan, and TrainerWiring's factories.
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/fsdp/fsdp_adapters.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/pipeline/pipeline_layout.h"
#include "cohort/plan/training_plan.h"
#include "cohort/train/progress.h"
#include "cohort/train/rng_state.h"
#include "cohort/train/sampled_data_source.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/version.h"
#include "cohort/wiring/mesh_wiring.h"
#include "cohort/wiring/trainer_wiring.h"

// Tensor parallelism: one layer's parameters and work split over a group of ranks (Megatron-LM's
// scheme, Shoeybi et al. 2019), and the building blocks a layer — built-in or custom — is made
// tensor-parallel with.
//
// Note [Tensor parallelism]. With TrainOptions.tp = t, every pipeline rank of every replica is t
// ranks (Topology::tp, the fastest-varying rank), which hold the same layers, each a part of
// their parameters, and run the same program on the same micro-batches. Between the layers the
// activations are whole and identical on the t ranks; inside them:
//   - a column-parallel Linear (y = x W^T + b, W [out, in]) holds rows [r out/t, (r+1) out/t) of
//     W and b and computes its slice of y: no communication forward; its input gradient is a
//     partial sum, all-reduced over the group (Megatron's f operator);
//   - a row-parallel Linear holds columns [r in/t, (r+1) in/t) of W, takes the column-parallel
//     layer's slice as input and all-reduces its output (g): the bias (and a residual) is added
//     by rank 0 only, before the sum, so it is counted once; its input gradient needs nothing.
// The GPT block's attention splits heads (qkv column-parallel with its q, k and v thirds split
// alike, the attention of the rank's heads, the projection row-parallel) and its MLP the hidden
// width (fc column-parallel, GELU, proj row-parallel): one all-reduce per sub-layer forward and
// one backward. The Llama block splits alike: its fused qkv in three unequal sections (q of the
// rank's heads/t query heads, k and v of its kv_heads/t key-value heads, so each of its query
// heads reads a key-value head it holds), its fused gate_up in two (the rank's ffn/t gate and up
// units), o_proj and down_proj row-parallel, the RMSNorms replicated. The token embedding is
// vocab-parallel (each rank looks up the tokens of its
// vocabulary range and the partial rows are all-reduced), the LM head is column-parallel over the
// vocabulary, and the loss reads only its rank's logits (max, sum of exponentials and the target's
// logit reduced over the group), so no rank holds the whole [B, T, V] logits. LayerNorms, biases
// of row-parallel layers and position embeddings are replicated: every rank computes the same
// gradient for them, counted once in the gradient norm.
//
// Numerics: at one t everything is deterministic (the group's all-reduce sums in rank order), so
// pipeline depth, replicas and backends give the same bits as before; across t the sums are split
// differently and the results agree within rounding (docs/runtime.md, "Tensor parallelism").
//
// Note [Tensor-parallel shards]. Parameters are named and initialised as the whole tensor (the
// initialisers of pipewright/init.h draw element i of the WHOLE tensor for each element of the
// part), so a layer's weights are the same numbers at any t, and checkpoints store whole tensors:
// TensorShard says which elements a part holds. The split axis is a sequence of sections, each
// seen as [parts, piece], and part r holds piece r of every section, in section order: a fused
// qkv weight has three (part r holds its heads' rows of q, of k and of v), of unequal sizes under
// grouped-query attention (q's heads, then the fewer key and value heads).
#ifndef PIPEWRIGHT_TENSOR_PARALLEL_H_
#define PIPEWRIGHT_TENSOR_PARALLEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/layer.h"

namespace pipewright {

// A stage's tensor-parallel group, as a layer call sees it (LayerContext::tp).
struct TensorParallelGroup {
  Communicator* comm = nullptr;  // group rank = tensor-parallel rank
  int rank = 0, size = 1;
  absl::Duration timeout = absl::InfiniteDuration();
  // Note [Sequence parallelism]: activations outside the products are split along the sequence.
  bool sequence_parallel = false;
  // Seconds the calls spent in this group's collectives, from posting to completion (the engine
  // reports them per step as RankTimes::tensor_parallel and resets them).
  mutable double collective_s = 0;
};

// Whether the call runs with sequence parallelism (a group of 2 or more that splits sequences).
inline bool SequenceParallel(const LayerContext& ctx) {
  return ctx.tp != nullptr && ctx.tp->size > 1 && ctx.tp->sequence_parallel;
}

// In-place sum of `t` over ctx.tp's group, in rank order (nothing without a group or at size
// 1). A failure or timeout aborts the group (so the other ranks stop waiting) and names `what`.
absl::Status TensorParallelAllReduce(const LayerContext& ctx, Tensor& t, absl::string_view what);
// Every rank's `in` concatenated in rank order into `out` (Communicator::AllGather).
absl::Status TensorParallelAllGather(const LayerContext& ctx, const Tensor& in, Tensor& out,
                                     absl::string_view what);
// Note [Sequence parallelism] (Korthikanti et al. 2022). With RunSpec.sequence_parallel the
// activations between the tensor-parallel products — the LayerNorms, the residual stream, what
// pipeline stages send each other — are split along the sequence: rank r of t holds positions
// [r T/t, (r+1) T/t) of every sequence, [B, T/t, ...], so their memory and the pipeline's
// messages shrink t-fold. A column-parallel product all-gathers its input's sequence first
// (SequenceAllGather) and reduce-scatters its input gradient (SequenceReduceScatter) where it
// all-reduced it; a row-parallel product reduce-scatters its output where it all-reduced it (the
// bias and residual then added by every rank to its rows) and all-gathers its output gradient.
// The same bytes on a ring as the all-reduce it replaces. A LayerNorm's weight gradient is then
// a sum over the rank's positions only: its BackwardWeight all-reduces it over the group. The
// column-parallel layer keeps its input's rows (not the gathered sequence) for the weight
// gradient and gathers them again there. The regroupings are copies on the tensors' device.
//
// [B, T/t, ...] of every rank -> [B, T, ...] in rank order along the sequence (dimension 1).
absl::StatusOr<Tensor> SequenceAllGather(const LayerContext& ctx, const Tensor& x,
                                         absl::string_view what);
// y [B, T, ...] summed over the group; rank r keeps positions [r T/t, (r+1) T/t): [B, T/t, ...].
// T must be a multiple of t. f32.
absl::StatusOr<Tensor> SequenceReduceScatter(const LayerContext& ctx, const Tensor& y,
                                             absl::string_view what);

// FailedPrecondition unless `ctx` carries a group of `size` ranks with this rank `rank` (a layer
// built as part `rank` of `size` checks its call): nothing to check at size 1.
absl::Status CheckTensorParallelCall(const LayerContext& ctx, int rank, int size,
                                     absl::string_view what);

// The part of a whole tensor of `shape` that rank init.tp_rank of init.tp_size holds when split
// along `axis` in `sections` (whole sizes along the axis, summing to its size; empty: one), each
// section split in tp_size pieces. InvalidArgument naming `what` when tp_size does not divide a
// section.
absl::StatusOr<TensorShard> ShardOf(const InitContext& init, const std::vector<int64_t>& shape,
                                    int axis, const std::vector<int64_t>& sections,
                                    absl::string_view what);
// The same with `groups` equal sections.
absl::StatusOr<TensorShard> ShardOf(const InitContext& init, const std::vector<int64_t>& shape,
                                    int axis, int64_t groups, absl::string_view what);
// `groups` equal sections of a size-`size` axis (ShardOf's sections; a size that `groups` does not
// divide gives sections ShardOf refuses).
std::vector<int64_t> EqualSections(int64_t size, int64_t groups);
// The shape of `shard`'s part of a whole tensor of `shape`.
std::vector<int64_t> PartShape(std::vector<int64_t> shape, const TensorShard& shard);
// The whole tensor's shape of a parameter (its value's, or the tensor it is a part of).
std::vector<int64_t> WholeShape(const Parameter& p);
// The whole tensor's element index of element `i` of the part (of shape `part_shape`).
int64_t WholeIndex(const TensorShard& shard, const std::vector<int64_t>& part_shape, int64_t i);
// MakeParameter (init.h) of `shard`'s part of a whole tensor of `shape`: named as the whole, its
// value and gradient of the part's shape, `shard` recorded (Parameter::shard). InitNormal and
// InitUniform then draw the whole tensor's elements for it.
Parameter MakeShardedParameter(const InitContext& init, const std::string& local,
                               const std::vector<int64_t>& shape, bool weight_decay,
                               const TensorShard& shard);
// Host tensors: `shard`'s part of `whole` (a new tensor), and the whole tensor from every part in
// rank order (parts[r] with index r). InvalidArgument when a shape does not fit.
absl::StatusOr<Tensor> SlicePart(const Tensor& whole, const TensorShard& shard);
absl::StatusOr<Tensor> MergeParts(const std::vector<Tensor>& parts, const TensorShard& shard);

namespace layers {
// The building blocks of a tensor-parallel custom layer (docs/custom_layers.md), created as
// children with the layer's InitContext (its tp_rank and tp_size). Weights [out, in] as
// layers::Linear, named "weight" and "bias" under the child's name, initialised N(0, std^2) and 0.
// Column-parallel: the rank's `out / tp` outputs (the split axis seen as `groups` blocks, each
// split alike: groups = 3 for a fused qkv); its input gradient is all-reduced.
LayerSpecPtr ColumnParallelLinear(int64_t in, int64_t out, bool bias = true, int64_t groups = 1,
                                  float std = 0.02f);
// Row-parallel: input the rank's `in / tp` features (a column-parallel layer's output), output
// the whole [.., out] summed over the group; the bias is replicated and added once.
LayerSpecPtr RowParallelLinear(int64_t in, int64_t out, bool bias = true, float std = 0.02f);
}  // namespace layers

}  // namespace pipewright

#endif  // PIPEWRIGHT_TENSOR_PARALLEL_H_

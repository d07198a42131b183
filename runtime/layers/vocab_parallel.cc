// The vocab-parallel embedding and loss (Note [Tensor parallelism] in
// pipewright/tensor_parallel.h): the passes EmbeddingLayer and CrossEntropyLayer take at a
// tensor-parallel size above 1. The rank holds the vocabulary range [r V/t, (r+1) V/t) of the token
// table and of the logits; nothing here materialises all V columns of a row. The work is in ops
// (EmbeddingPart*, RowMax, CrossEntropyPart*), on the rank's device.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "pipewright/tensor_parallel.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright::internal {

// Rank 0's rows are wte[token] + wpe[t] for its tokens and wpe[t] for the others; the other ranks'
// are wte[token] or zero. Their rank-order sum is wte[token] + wpe[t] exactly as at tp = 1
// (adding zero and swapping two operands change no bits), so the embedding's output does not
// depend on the size.
absl::StatusOr<Tensor> EmbeddingLayer::ForwardParallel(const Tensor& x, const LayerContext& ctx) {
  PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "embedding"));
  const int64_t B = x.dim(0), T = x.dim(1);
  const int64_t begin = tp_rank_ * wte_.value.dim(0);
  Tensor y = Tensor::Empty({B, T, dim_}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::EmbeddingPartForward(ops::ExecOf(ctx), x, wte_.value, begin,
                                               tp_rank_ == 0 ? wpe_.value : Tensor(), y, B, T,
                                               dim_));
  // Under sequence parallelism each rank keeps the sum's rows of its positions.
  if (SequenceParallel(ctx)) {
    return SequenceReduceScatter(ctx, y, "vocab-parallel embedding's rows");
  }
  PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, y, "vocab-parallel embedding's rows"));
  return y;
}

// The rank's token rows get the gradients of their tokens, in the order EmbeddingBackward adds
// them (so the same bits as at tp = 1); the positions' gradient is whole on every rank.
absl::Status EmbeddingLayer::BackwardWeightParallel(const Tensor& tokens, const Tensor& dy,
                                                    const LayerContext& ctx) {
  return ops::EmbeddingPartBackward(ops::ExecOf(ctx), dy, tokens, tp_rank_ * wte_.grad.dim(0),
                                    wte_.grad, wpe_.grad, tokens.dim(0), tokens.dim(1), dim_);
}

// The loss from the rank's logits [rows, V/t]: the row maxima are all-gathered (the row's
// maximum over the group, M), then each rank's sum of exp(l - M) over its columns and the
// target's logit (from the rank whose range holds it, zero elsewhere) are all-reduced in one
// f64 vector, and loss_r = log(sum) + M - l_target. Saved: the logits, the targets and the
// stats {sum[rows], target[rows], M[rows], count} for the backward.
absl::StatusOr<Tensor> CrossEntropyLayer::ForwardParallel(const Tensor& x, const Tensor& targets,
                                                          const LayerContext& ctx, Saved* saved) {
  PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "loss"));
  const int64_t part = x.dim(-1), rows = targets.numel();
  PW_RETURN_IF_ERROR(CheckTargets(targets, part * tp_size_));
  const ops::Exec e = ops::ExecOf(ctx);
  Allocator* a = AllocatorOf(ctx);
  Tensor mine = Tensor::Empty({rows}, DType::kF32, a);
  PW_RETURN_IF_ERROR(ops::RowMax(e, x, rows, part, mine));
  Tensor all = Tensor::Empty({tp_size_, rows}, DType::kF32, a);
  PW_RETURN_IF_ERROR(TensorParallelAllGather(ctx, mine, all, "the loss's row maxima"));
  Tensor stats = Tensor::Empty({3 * rows + 1}, DType::kF64, a);
  PW_RETURN_IF_ERROR(
      ops::CrossEntropyPartStats(e, x, targets, tp_rank_ * part, all, tp_size_, rows, part, stats));
  PW_ASSIGN_OR_RETURN(Tensor sums, stats.View(0, {2 * rows}));
  PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, sums, "the loss's sums"));
  // The loss and the row count on the host (on a GPU this waits for the stream, as the
  // whole-vocabulary loss does).
  Tensor host = stats, host_targets = targets;
  if (!stats.device().is_cpu()) {
    PW_ASSIGN_OR_RETURN(host, stats.CopyTo(nullptr));
    PW_ASSIGN_OR_RETURN(host_targets, targets.CopyTo(nullptr));
  }
  const double* st = host.data<double>();
  const int32_t* t = host_targets.data<int32_t>();
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (t[i] < 0) continue;
    ++count;
    sum += std::log(st[i]) + st[2 * rows + i] - st[rows + i];
  }
  Tensor loss = Tensor::Empty({1}, DType::kF32);
  loss.data<float>()[0] = count > 0 ? static_cast<float>(sum / count) : 0.0f;
  Tensor n = Tensor::Empty({1}, DType::kF64);
  n.data<double>()[0] = static_cast<double>(count);
  saved->tensors = {x, targets, stats, n};
  return loss;
}

// dlogits[r, j] = g / count * (exp(l - M) / sum - [j is the target]) over the rank's columns.
absl::StatusOr<Tensor> CrossEntropyLayer::BackwardParallel(float g, const LayerContext& ctx,
                                                           Saved* saved) {
  const Tensor& x = saved->tensors[0];
  const Tensor& targets = saved->tensors[1];
  const int64_t part = x.dim(-1), rows = targets.numel();
  const int64_t count = static_cast<int64_t>(saved->tensors[3].data<double>()[0]);
  const float scale = count > 0 ? g / static_cast<float>(count) : 0.0f;
  Tensor dx = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(ops::CrossEntropyPartBackward(ops::ExecOf(ctx), x, targets, tp_rank_ * part,
                                                   saved->tensors[2], rows, part, scale, dx));
  saved->Clear();
  return dx;
}

}  // namespace pipewright::internal

// The vocab-parallel embedding and loss (Note [Tensor parallelism] in
// pipewright/tensor_parallel.h): the passes EmbeddingLayer and CrossEntropyLayer take at a
// tensor-parallel size above 1. The rank holds the vocabulary range [r V/t, (r+1) V/t) of the token
// table and of the logits; nothing here materialises all V columns of a row.
//
// Host tensors only: a CUDA rank is refused by name (the kernels of these passes are CPU loops).
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/tensor_parallel.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright::internal {

namespace {

absl::Status OnHost(std::initializer_list<const Tensor*> ts, absl::string_view what) {
  for (const Tensor* t : ts) {
    if (t->defined() && !t->device().is_cpu()) {
      return absl::UnimplementedError(
          absl::StrCat(what, ": the vocab-parallel passes run on the CPU only; this tensor is on ",
                       t->device().ToString()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Rank 0's rows are wte[token] + wpe[t] for its tokens and wpe[t] for the others; the other ranks'
// are wte[token] or zero. Their rank-order sum is wte[token] + wpe[t] exactly as at tp = 1
// (adding zero and swapping two operands change no bits), so the embedding's output does not
// depend on the size.
absl::StatusOr<Tensor> EmbeddingLayer::ForwardParallel(const Tensor& x, const LayerContext& ctx) {
  PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "embedding"));
  PW_RETURN_IF_ERROR(OnHost({&x, &wte_.value, &wpe_.value}, "embedding"));
  const int64_t B = x.dim(0), T = x.dim(1), C = dim_;
  const int64_t part = wte_.value.dim(0), begin = tp_rank_ * part;
  Tensor y = Tensor::Empty({B, T, C}, DType::kF32, AllocatorOf(ctx));
  const int32_t* tok = x.data<int32_t>();
  const float* wte = wte_.value.data<float>();
  const float* wpe = wpe_.value.data<float>();
  float* out = y.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t, v = tok[bt] - begin;
      const float* w = v >= 0 && v < part ? wte + v * C : nullptr;
      const float* p = tp_rank_ == 0 ? wpe + t * C : nullptr;
      float* o = out + bt * C;
      for (int64_t c = 0; c < C; ++c) {
        o[c] = w != nullptr ? (p != nullptr ? w[c] + p[c] : w[c]) : (p != nullptr ? p[c] : 0.0f);
      }
    }
  }
  // Under sequence parallelism each rank keeps the sum's rows of its positions.
  if (SequenceParallel(ctx))
    return SequenceReduceScatter(ctx, y, "vocab-parallel embedding's rows");
  PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, y, "vocab-parallel embedding's rows"));
  return y;
}

// The rank's token rows get the gradients of their tokens, in the order cpu::EmbeddingBackward
// adds them (so the same bits as at tp = 1); the positions' gradient is whole on every rank.
absl::Status EmbeddingLayer::BackwardWeightParallel(const Tensor& tokens, const Tensor& dy) {
  PW_RETURN_IF_ERROR(OnHost({&tokens, &dy, &wte_.grad}, "embedding backward"));
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = dim_;
  const int64_t part = wte_.grad.dim(0), begin = tp_rank_ * part;
  const int32_t* tok = tokens.data<int32_t>();
  const float* d = dy.data<float>();
  float* dwte = wte_.grad.data<float>();
  float* dwpe = wpe_.grad.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t, v = tok[bt] - begin;
      const float* g = d + bt * C;
      if (v >= 0 && v < part) {
        float* w = dwte + v * C;
        for (int64_t c = 0; c < C; ++c) w[c] += g[c];
      }
      float* p = dwpe + t * C;
      for (int64_t c = 0; c < C; ++c) p[c] += g[c];
    }
  }
  return absl::OkStatus();
}

// The loss from the rank's logits [rows, V/t]: the row maxima are all-gathered (the row's
// maximum over the group, M), then each rank's sum of exp(l - M) over its columns and the
// target's logit (from the rank whose range holds it, zero elsewhere) are all-reduced in one
// f64 vector, and loss_r = log(sum) + M - l_target. Saved: the logits, the targets and
// {count, M[rows], sum[rows]} for the backward.
absl::StatusOr<Tensor> CrossEntropyLayer::ForwardParallel(const Tensor& x, const Tensor& targets,
                                                          const LayerContext& ctx, Saved* saved) {
  PW_RETURN_IF_ERROR(CheckTensorParallelCall(ctx, tp_rank_, tp_size_, "loss"));
  PW_RETURN_IF_ERROR(OnHost({&x, &targets}, "loss"));
  const int64_t part = x.dim(-1), rows = targets.numel(), vocab = part * tp_size_;
  const int64_t begin = tp_rank_ * part;
  const float* l = x.data<float>();
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i) {
    if (t[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loss: target %d at row %d is outside the vocabulary [0, %d)", t[i], i, vocab));
    }
  }
  Tensor mine = Tensor::Empty({rows}, DType::kF32);
  for (int64_t i = 0; i < rows; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < part; ++j) m = std::max(m, l[i * part + j]);
    mine.data<float>()[i] = m;
  }
  Tensor all = Tensor::Empty({tp_size_, rows}, DType::kF32);
  PW_RETURN_IF_ERROR(TensorParallelAllGather(ctx, mine, all, "the loss's row maxima"));
  Tensor stats = Tensor::Zeros({1 + 2 * rows}, DType::kF64);  // count, M, sum
  double* st = stats.data<double>();
  Tensor reduced = Tensor::Zeros({2 * rows}, DType::kF64);  // sum, target logit
  double* rd = reduced.data<double>();
  for (int64_t i = 0; i < rows; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < tp_size_; ++r) m = std::max(m, all.data<float>()[r * rows + i]);
    st[1 + i] = m;
    if (t[i] < 0) continue;  // an ignored row
    double s = 0;
    for (int64_t j = 0; j < part; ++j) s += std::exp(static_cast<double>(l[i * part + j]) - m);
    rd[i] = s;
    const int64_t v = t[i] - begin;
    if (v >= 0 && v < part) rd[rows + i] = l[i * part + v];
  }
  PW_RETURN_IF_ERROR(TensorParallelAllReduce(ctx, reduced, "the loss's sums"));
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    st[1 + rows + i] = rd[i];
    if (t[i] < 0) continue;
    ++count;
    sum += std::log(rd[i]) + st[1 + i] - rd[rows + i];
  }
  st[0] = static_cast<double>(count);
  Tensor loss = Tensor::Empty({1}, DType::kF32);
  loss.data<float>()[0] = count > 0 ? static_cast<float>(sum / count) : 0.0f;
  saved->tensors = {x, targets, stats};
  return loss;
}

// dlogits[r, j] = g / count * (exp(l - M) / sum - [j is the target]) over the rank's columns.
absl::StatusOr<Tensor> CrossEntropyLayer::BackwardParallel(float g, const LayerContext& ctx,
                                                           Saved* saved) {
  const Tensor& x = saved->tensors[0];
  const Tensor& targets = saved->tensors[1];
  const double* st = saved->tensors[2].data<double>();
  const int64_t part = x.dim(-1), rows = targets.numel(), begin = tp_rank_ * part;
  const int64_t count = static_cast<int64_t>(st[0]);
  const float scale = count > 0 ? g / static_cast<float>(count) : 0.0f;
  Tensor dx = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(OnHost({&dx}, "loss backward"));
  const float* l = x.data<float>();
  const int32_t* t = targets.data<int32_t>();
  float* d = dx.data<float>();
  for (int64_t i = 0; i < rows; ++i) {
    float* row = d + i * part;
    if (t[i] < 0) {
      for (int64_t j = 0; j < part; ++j) row[j] = 0.0f;
      continue;
    }
    const double m = st[1 + i], inv = 1.0 / st[1 + rows + i];
    for (int64_t j = 0; j < part; ++j) {
      const double p = std::exp(static_cast<double>(l[i * part + j]) - m) * inv;
      row[j] = static_cast<float>(scale * (p - (begin + j == t[i] ? 1.0 : 0.0)));
    }
  }
  saved->Clear();
  return dx;
}

}  // namespace pipewright::internal

// A custom layer written outside the library, against the installed public headers only
// (pipewright/layer.h, ops.h, init.h): the install test's consumer stages a model with it, and
// tests/runtime/custom_layer_test.cc checks it against a double-precision reference. It is the
// example of docs/custom_layers.md.
//
//   y = x + scale * (x W^T) + b      x, y [..., dim]; W [dim, dim] (row-major, like nn.Linear)
//
// W ~ U(-1/sqrt(dim), 1/sqrt(dim)) and b = 0, both keyed by (seed, parameter name), so the
// layer initialises identically on any pipeline stage. It runs on the device of the context's
// allocator (every op goes through pipewright/ops.h) and honours ctx.compute_dtype: with bf16
// or f16 the matrix products take 16-bit operands with fp32 accumulation.
#ifndef PIPEWRIGHT_TESTS_INSTALL_RESIDUAL_LINEAR_H_
#define PIPEWRIGHT_TESTS_INSTALL_RESIDUAL_LINEAR_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "pipewright/init.h"
#include "pipewright/layer.h"
#include "pipewright/ops.h"

namespace residual_example {

using pipewright::DType;
using pipewright::Tensor;
namespace ops = pipewright::ops;

// `t` as a matrix-product operand of `dtype`: itself for f32, else a 16-bit copy.
inline absl::StatusOr<Tensor> GemmOperand(const ops::Exec& e, const Tensor& t, DType dtype) {
  if (dtype == DType::kF32) return t;
  return ops::Cast(e, t, dtype);
}

class ResidualLinear final : public pipewright::Layer {
 public:
  ResidualLinear(const pipewright::InitContext& init, int64_t dim, float scale)
      : dim_(dim), scale_(scale) {
    weight_ = pipewright::MakeParameter(init, "weight", {dim, dim}, /*weight_decay=*/true);
    const float bound = 1.0f / std::sqrt(static_cast<float>(dim));
    pipewright::InitUniform(weight_, init, -bound, bound);
    bias_ = pipewright::MakeParameter(init, "bias", {dim}, /*weight_decay=*/false);
    pipewright::InitConstant(bias_, 0.0f);
  }

  absl::string_view kind() const override { return "residual_linear"; }

  // Saves x (in the compute dtype).
  absl::StatusOr<Tensor> Forward(const Tensor& x, const pipewright::LayerContext& ctx,
                                 pipewright::Saved* saved) override {
    PW_ASSIGN_OR_RETURN(int64_t rows, pipewright::CheckRows(x, dim_, "residual_linear"));
    const ops::Exec e = ops::ExecOf(ctx);
    PW_ASSIGN_OR_RETURN(Tensor xc, GemmOperand(e, x, ctx.compute_dtype));
    PW_ASSIGN_OR_RETURN(Tensor wc, GemmOperand(e, weight_.value, ctx.compute_dtype));
    Tensor y = Tensor::Empty(x.shape(), DType::kF32, pipewright::AllocatorOf(ctx));
    PW_RETURN_IF_ERROR(ops::Gemm(e, false, true, rows, dim_, dim_, scale_, xc, dim_, wc, dim_,
                                 /*beta=*/0.0f, y, dim_));
    PW_RETURN_IF_ERROR(ops::BiasAdd(e, y, bias_.value, rows, dim_));
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, y, x));
    saved->tensors = {std::move(xc)};
    return y;
  }

  // dx = dy + scale * dy W. Adds dy to the saved record for BackwardWeight.
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const pipewright::LayerContext& ctx,
                                       pipewright::Saved* saved) override {
    if (saved->tensors.size() != 1) {
      return absl::FailedPreconditionError("residual_linear: backward without a forward");
    }
    const Tensor& xc = saved->tensors[0];
    PW_RETURN_IF_ERROR(pipewright::CheckGradShape(dy, xc.shape(), "residual_linear backward"));
    const ops::Exec e = ops::ExecOf(ctx);
    const int64_t rows = dy.numel() / dim_;
    PW_ASSIGN_OR_RETURN(Tensor dyc, GemmOperand(e, dy, xc.dtype()));  // the forward's precision
    PW_ASSIGN_OR_RETURN(Tensor wc, GemmOperand(e, weight_.value, xc.dtype()));
    Tensor dx = Tensor::Empty(dy.shape(), DType::kF32, pipewright::AllocatorOf(ctx));
    PW_RETURN_IF_ERROR(ops::Copy(e, dy, dx));  // the residual path
    PW_RETURN_IF_ERROR(ops::Gemm(e, false, false, rows, dim_, dim_, scale_, dyc, dim_, wc, dim_,
                                 /*beta=*/1.0f, dx, dim_));
    saved->tensors.push_back(dy);
    return dx;
  }

  // dW += scale * dy^T x, db += sum over rows of dy; then frees the record.
  absl::Status BackwardWeight(const pipewright::LayerContext& ctx,
                              pipewright::Saved* saved) override {
    if (saved->tensors.size() != 2) {
      return absl::FailedPreconditionError("residual_linear: BackwardWeight before BackwardInput");
    }
    const ops::Exec e = ops::ExecOf(ctx);
    const Tensor& xc = saved->tensors[0];
    const Tensor& dy = saved->tensors[1];
    const int64_t rows = dy.numel() / dim_;
    PW_ASSIGN_OR_RETURN(Tensor dyc, GemmOperand(e, dy, xc.dtype()));
    PW_RETURN_IF_ERROR(ops::Gemm(e, true, false, dim_, dim_, rows, scale_, dyc, dim_, xc, dim_,
                                 /*beta=*/1.0f, weight_.grad, dim_));
    PW_RETURN_IF_ERROR(ops::BiasBackward(e, dy, bias_.grad, rows, dim_));
    saved->Clear();
    return absl::OkStatus();
  }

  std::vector<pipewright::Parameter*> Parameters() override { return {&weight_, &bias_}; }

 private:
  int64_t dim_;
  float scale_;
  pipewright::Parameter weight_, bias_;
};

class ResidualLinearSpec final : public pipewright::LayerSpec {
 public:
  ResidualLinearSpec(int64_t dim, float scale) : dim_(dim), scale_(scale) {}
  std::string kind() const override { return "residual_linear"; }
  pipewright::Cost GetCost(const pipewright::MicroBatchShape& shape, int64_t) const override {
    const double n = static_cast<double>(shape.tokens()), d = static_cast<double>(dim_);
    pipewright::Cost c;
    c.params = dim_ * dim_ + dim_;
    c.forward_flops = 2 * n * d * d + 2 * n * d;  // the product, the bias and the residual
    c.backward_flops = 4 * n * d * d + 2 * n * d;
    c.activation_bytes = shape.tokens() * dim_ * 4;  // x
    c.output_bytes = shape.tokens() * dim_ * 4;
    return c;
  }
  absl::StatusOr<std::unique_ptr<pipewright::Layer>> Create(
      const pipewright::InitContext& init) const override {
    return std::make_unique<ResidualLinear>(init, dim_, scale_);
  }
  std::string Config() const override { return absl::StrFormat("dim=%d,scale=%g", dim_, scale_); }

 private:
  int64_t dim_;
  float scale_;
};

inline pipewright::LayerSpecPtr MakeResidualLinear(int64_t dim, float scale) {
  return std::make_shared<ResidualLinearSpec>(dim, scale);
}

}  // namespace residual_example

#endif  // PIPEWRIGHT_TESTS_INSTALL_RESIDUAL_LINEAR_H_

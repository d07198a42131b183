// What a layer (built-in or custom) needs to create its parameters and check its inputs
// (docs/custom_layers.md):
//   - parameters named globally and initialised identically whichever pipeline stage creates
//     them: MakeParameter, InitNormal, InitUniform, InitConstant, ChildInit;
//   - the checks a layer runs on its input and its output gradient: CheckRows, CheckGradShape;
//   - the allocator of a layer call: AllocatorOf.
//
// Stage independence. LayerGraph::Instantiate gives every layer an InitContext with the run's
// seed and the layer's node name. A parameter's name is that name plus a local suffix
// ("blocks.3.attn.qkv.weight"), and the random initialisers draw from a counter-based generator
// keyed by (seed, the parameter's full name) and indexed by element: the values depend on
// neither the layer's stage, nor the order in which layers or parameters are created, nor the
// other layers in the model. A layer that uses only these initialisers (and keeps its parameter
// names stable) therefore has bit-identical weights on any stage of any plan, and a checkpoint's
// tensor names match its parameters.
//
// Parameters are initialised on the host: LayerSpec::Create runs with a host allocator (the
// engine moves parameters to the rank's device afterwards), and the initialisers write host
// memory (they abort on a device tensor, like Tensor::Fill).
#ifndef PIPEWRIGHT_INIT_H_
#define PIPEWRIGHT_INIT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/layer.h"
#include "pipewright/tensor.h"

namespace pipewright {

// The allocator a layer call allocates its outputs and scratch from: ctx.allocator, or
// DefaultCpuAllocator() when it is null (the same one ops::ExecOf(ctx) runs on).
inline Allocator* AllocatorOf(const LayerContext& ctx) {
  return ctx.allocator != nullptr ? ctx.allocator : DefaultCpuAllocator();
}

// The InitContext of a sub-layer called `local` (composite layers): the same seed, layer index,
// depth and allocator, named init.name + "." + local (just `local` when init.name is empty), so
// the sub-layer's parameters get globally unique names ("blocks.3.attn" + ".qkv").
InitContext ChildInit(const InitContext& init, absl::string_view local);

// A new parameter named init.name + "." + local (just `local` when init.name is empty), with an
// uninitialised f32 value of `shape` and a zeroed f32 gradient, both from init.allocator.
// `weight_decay` is false for biases, norms' scales and shifts and position embeddings. The
// caller initialises the value with one of the functions below and owns the Parameter (a
// Layer returns pointers to its parameters from Parameters()).
Parameter MakeParameter(const InitContext& init, const std::string& local,
                        std::vector<int64_t> shape, bool weight_decay);

// value ~ N(0, std^2), element i drawn at (seed, p.name, i): independent of the stage (see
// above). `p` was created by MakeParameter with `init`; its value is a host tensor.
void InitNormal(Parameter& p, const InitContext& init, float std);
// value ~ U(low, high), drawn like InitNormal (e.g. PyTorch's Linear default, bound
// 1 / sqrt(in)).
void InitUniform(Parameter& p, const InitContext& init, float low, float high);
// value = `value` everywhere (biases 0, norm scales 1). Host tensors only.
void InitConstant(Parameter& p, float value);

// Checks that `x` is a defined f32 tensor whose last dimension is `cols`, and returns the
// number of rows (numel / cols). InvalidArgument "<what>: expected an f32 input with last
// dimension <cols>, got <shape>" otherwise. Runs on the host; reads no tensor data.
absl::StatusOr<int64_t> CheckRows(const Tensor& x, int64_t cols, absl::string_view what);
// Checks that an incoming gradient `dy` is a defined f32 tensor with the element count and the
// last dimension of the forward output's shape `expected` (a reshaped gradient is accepted; a
// smaller one would make the weight-gradient kernels read past its end). InvalidArgument
// naming `what` otherwise.
absl::Status CheckGradShape(const Tensor& dy, const std::vector<int64_t>& expected,
                            absl::string_view what);

}  // namespace pipewright

#endif  // PIPEWRIGHT_INIT_H_

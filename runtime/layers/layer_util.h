// Helpers shared by the built-in layers (internal).
#ifndef PIPEWRIGHT_RUNTIME_LAYERS_LAYER_UTIL_H_
#define PIPEWRIGHT_RUNTIME_LAYERS_LAYER_UTIL_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "pipewright/layer.h"
#include "runtime/random.h"

namespace pipewright::internal {

inline Allocator* Alloc(const LayerContext& ctx) {
  return ctx.allocator ? ctx.allocator : DefaultCpuAllocator();
}

// A parameter of `shape` named prefix + "." + local, with a zeroed gradient.
Parameter MakeParameter(const InitContext& init, const std::string& local,
                        std::vector<int64_t> shape, bool weight_decay);
// value ~ N(0, std^2), keyed by (seed, layer index, parameter name).
void InitNormal(Parameter& p, const InitContext& init, float std);
void InitConstant(Parameter& p, float value);

// Checks x is f32 with last dimension `cols`; returns the number of rows.
absl::StatusOr<int64_t> CheckRows(const Tensor& x, int64_t cols, absl::string_view what);
// Checks an incoming gradient is f32 with the forward output's element count and last dim.
absl::Status CheckGradShape(const Tensor& dy, const std::vector<int64_t>& expected,
                            absl::string_view what);

inline InitContext Child(const InitContext& init, absl::string_view local) {
  InitContext c = init;
  c.name = init.name.empty() ? std::string(local) : absl::StrCat(init.name, ".", local);
  return c;
}

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_LAYERS_LAYER_UTIL_H_

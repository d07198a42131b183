// Builds against an installed pipewright and stages models through the public API: a preset,
// and a model with a custom layer (residual_linear.h, which includes only installed headers)
// whose parameters must be identical whichever stage range instantiates them and whose
// backward must match a finite difference.
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "pipewright/model.h"
#include "residual_linear.h"

namespace {

using pipewright::Tensor;

int Fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

// sum(layer(x) * probe), accumulated in double.
double Objective(pipewright::Layer& layer, const Tensor& x, const Tensor& probe) {
  pipewright::Saved saved;
  auto y = layer.Forward(x, {}, &saved);
  if (!y.ok()) return NAN;
  double s = 0;
  for (int64_t i = 0; i < y->numel(); ++i) {
    s += double{y->data<float>()[i]} * probe.data<float>()[i];
  }
  return s;
}

// A deterministic, irregular host tensor.
Tensor Wave(std::vector<int64_t> shape, float phase) {
  Tensor t = Tensor::Empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::sin(1.7f * i + phase);
  return t;
}

}  // namespace

int main() {
  auto preset = pipewright::PresetModel("gpt-tiny", 0);
  if (!preset.ok() || preset->num_layers() != 8) return Fail("gpt-tiny preset");

  constexpr int64_t kDim = 4;
  pipewright::ModelBuilder b("custom", {.batch = 2, .seq_len = 3});
  b.Add("in", pipewright::layers::Linear(kDim, kDim));
  b.Add("res", residual_example::MakeResidualLinear(kDim, 0.5f));
  b.Add("act", pipewright::layers::Gelu());
  b.Add("out", residual_example::MakeResidualLinear(kDim, 0.5f));
  auto graph = b.Build();
  if (!graph.ok()) return Fail("building the custom model");

  // The custom layer's weights are the same in the whole model and in a one-layer stage.
  auto whole = graph->Instantiate(0, graph->num_layers(), 7);
  auto alone = graph->Instantiate(1, 2, 7);
  if (!whole.ok() || !alone.ok()) return Fail("instantiating stages");
  std::vector<float> in_whole, in_alone;
  for (pipewright::Parameter* p : (*whole)->Parameters()) {
    if (p->name == "res.weight") in_whole = p->value.ToVector();
  }
  for (pipewright::Parameter* p : (*alone)->Parameters()) {
    if (p->name == "res.weight") in_alone = p->value.ToVector();
  }
  if (in_whole.size() != static_cast<size_t>(kDim * kDim) || in_whole != in_alone) {
    return Fail("res.weight differs between stage ranges");
  }

  // Backward against a central difference along a direction v: <dx, v> = dL/dh L(x + h v).
  pipewright::Layer& layer = (*alone)->layer(0);
  const Tensor x = Wave({2, 3, kDim}, 0.1f), v = Wave({2, 3, kDim}, 0.9f),
               probe = Wave({2, 3, kDim}, 2.3f);
  pipewright::Saved saved;
  if (!layer.Forward(x, {}, &saved).ok()) return Fail("custom forward");
  auto dx = layer.Backward(probe, {}, &saved);
  if (!dx.ok()) return Fail("custom backward");
  double analytic = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    analytic += double{dx->data<float>()[i]} * v.data<float>()[i];
  }
  const float h = 1e-2f;
  Tensor plus = x.Clone(), minus = x.Clone();
  for (int64_t i = 0; i < x.numel(); ++i) {
    plus.data<float>()[i] += h * v.data<float>()[i];
    minus.data<float>()[i] -= h * v.data<float>()[i];
  }
  const double numeric =
      (Objective(layer, plus, probe) - Objective(layer, minus, probe)) / (2.0 * h);
  if (!(std::fabs(analytic - numeric) <= 1e-3 * std::fmax(1.0, std::fabs(numeric)))) {
    std::fprintf(stderr, "consumer: backward %.6f, finite difference %.6f\n", analytic, numeric);
    return 1;
  }
  std::printf("%s %d layers; custom model %d layers, backward %.6f = finite difference %.6f\n",
              preset->name().c_str(), preset->num_layers(), graph->num_layers(), analytic, numeric);
  return 0;
}

// ProfileModel: measured per-layer times of a layer graph on this machine's CPU
// (`pipewright model --profile`). The partitioner prefers them over FLOP-derived times, so they
// must time exactly what a pipeline stage runs: each layer's Forward, and its BackwardInput
// followed by its BackwardWeight (the order of a B action), on a realistic micro-batch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "pipewright/model.h"
#include "runtime/random.h"

namespace pipewright {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The value of `key` in a LayerSpec::Config() string ("vocab=256,max_seq=32,dim=64").
bool ConfigValue(const std::string& config, absl::string_view key, int64_t* value) {
  for (absl::string_view item : absl::StrSplit(config, ',')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    if (kv.first == key) return absl::SimpleAtoi(kv.second, value);
  }
  return false;
}

// [B, T] i32 tensor of values in [0, range), a pure function of (seed, salt, position) so that
// every run and every machine times the same micro-batch.
Tensor SyntheticTokens(int64_t batch, int64_t seq, int64_t range, uint64_t seed, uint64_t salt) {
  std::vector<int32_t> v(batch * seq);
  const uint64_t key = HashCombine(seed, salt);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<int32_t>(HashCombine(key, i) % static_cast<uint64_t>(range));
  }
  return Tensor::FromVectorI32({batch, seq}, v);
}

}  // namespace

absl::StatusOr<ModelCosts> ProfileModel(const LayerGraph& graph, int reps, uint64_t seed) {
  if (reps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("profiling needs reps >= 1, not ", reps));
  }
  const int n = graph.num_layers();
  if (n == 0) return absl::InvalidArgumentError("profiling: the model has no layers");
  // Refuse before Instantiate: the analytic presets (gpt3-175b ...) would otherwise try to
  // allocate terabytes. Weights and gradients are what instantiating and one backward cost at
  // least; activations come on top.
  const double weight_grad_bytes =
      2.0 * sizeof(float) * static_cast<double>(graph.TotalCost().params);
  if (weight_grad_bytes > static_cast<double>(kProfileMemoryLimitBytes)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot profile '%s': its fp32 weights and gradients need %.0f bytes (%.2f GiB), over "
        "the %d GiB profiling limit; use its analytic costs (no profiling) instead",
        graph.name(), weight_grad_bytes, weight_grad_bytes / (1 << 30),
        kProfileMemoryLimitBytes >> 30));
  }
  const LayerNode& first = graph.node(0);
  int64_t vocab = 0;
  if ((first.spec->kind() != "embedding" && first.spec->kind() != "token_embedding") ||
      !ConfigValue(first.spec->Config(), "vocab", &vocab) || vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("profiling needs a model whose first layer is a token embedding; '",
                     graph.name(), "' starts with ", first.name, " (", first.spec->kind(), ")"));
  }
  const int64_t B = graph.shape().batch, T = graph.shape().seq_len;
  // Shapes through the graph: the loss's targets index its input's last dimension, and a graph
  // without a loss is driven backward by a gradient of its output's shape.
  std::vector<int64_t> shape = {B, T};
  std::vector<int64_t> loss_input;
  for (int i = 0; i < n; ++i) {
    if (i == n - 1) loss_input = shape;
    shape = graph.node(i).spec->OutputShape(shape);
  }
  const bool has_loss = graph.node(n - 1).spec->kind() == "cross_entropy";
  Tensor tokens = SyntheticTokens(B, T, vocab, seed, /*salt=*/1);
  Tensor targets;
  if (has_loss) {
    const int64_t classes = loss_input.empty() ? 0 : loss_input.back();
    if (classes < 1) {
      return absl::InvalidArgumentError("profiling: the loss layer has no classes to target");
    }
    targets = SyntheticTokens(B, T, classes, seed, /*salt=*/2);
  }
  Tensor dy;
  if (has_loss) {
    dy = Tensor::Empty({1});
    dy.data<float>()[0] = 1.0f;  // one micro-batch's mean loss, as a single-stage step scales it
  } else {
    dy = Tensor::Empty(shape);
    dy.Fill(1.0f);
  }

  PW_ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, graph.Instantiate(0, n, seed));
  LayerContext ctx{nullptr, has_loss ? &targets : nullptr};
  std::vector<std::vector<double>> fwd(n), bwd(n);
  std::vector<Saved> saved(n);
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms caches and the allocator up
    Tensor h = tokens;
    for (int i = 0; i < n; ++i) {
      Clock::time_point t = Clock::now();
      absl::StatusOr<Tensor> y = stage->layer(i).Forward(h, ctx, &saved[i]);
      const double s = Seconds(t);
      if (!y.ok()) {
        return absl::Status(y.status().code(),
                            absl::StrCat("profiling layer ", i, " (", stage->name(i),
                                         ") forward: ", y.status().message()));
      }
      if (rep > 0) fwd[i].push_back(s);
      h = *std::move(y);
    }
    Tensor g = dy;
    for (int i = n; i-- > 0;) {
      Layer& layer = stage->layer(i);
      Clock::time_point t = Clock::now();
      absl::StatusOr<Tensor> dx = layer.BackwardInput(g, ctx, &saved[i]);
      absl::Status w = dx.ok() ? layer.BackwardWeight(ctx, &saved[i]) : dx.status();
      const double s = Seconds(t);
      if (!w.ok()) {
        return absl::Status(w.code(), absl::StrCat("profiling layer ", i, " (", stage->name(i),
                                                   ") backward: ", w.message()));
      }
      if (rep > 0) bwd[i].push_back(s);
      g = *std::move(dx);
    }
  }
  ModelCosts m = ToModelCosts(graph);
  for (int i = 0; i < n; ++i) {
    m.layers[i].forward_time_s = Median(fwd[i]);
    m.layers[i].backward_time_s = Median(bwd[i]);
  }
  return m;
}

}  // namespace pipewright

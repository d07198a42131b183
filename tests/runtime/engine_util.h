// Test helpers for engine runs: a flag-like description of a run turned into the engine's data
// (RunSpec, World, Dataset), and a single-stage reference training loop that shares no
// scheduling code with the engine.
#ifndef PIPEWRIGHT_TESTS_RUNTIME_ENGINE_UTIL_H_
#define PIPEWRIGHT_TESTS_RUNTIME_ENGINE_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/engine.h"
#include "pipewright/launch.h"
#include "pipewright/model.h"
#include "pipewright/run_spec.h"
#include "pipewright/train.h"
#include "pipewright/train_testing.h"

namespace pipewright::testing_util {

// gpt-tiny with 2 sequences per micro-batch: the model most engine tests train.
inline LayerGraph Tiny() {
  auto g = PresetModel("gpt-tiny", 2);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// What a test varies about a run (the CLI's flags, as data).
struct EngineSetup {
  TrainOptions train;
  TrainTestingHooks hooks;    // installed by MakeEngine (Engine::SetTestingHooks)
  int64_t micro_batches = 4;  // per replica
  int pp = 1, dp = 1, tp = 1;
  bool sequence_parallel = false;
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int chunks = 1;
  Recompute recompute = Recompute::kNone;
  std::vector<Recompute> stage_recompute;  // overrides `recompute` when not empty
  std::vector<int> stage_boundaries;       // empty: balanced
  absl::Duration timeout = absl::Seconds(60);
  Device device = Device::Cpu();
  std::vector<int> cuda_devices;
  std::optional<CommBackend> comm;
  std::string data = "synthetic";
};

inline absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const LayerGraph& graph,
                                                          const EngineSetup& s) {
  PW_ASSIGN_OR_RETURN(
      Schedule schedule,
      GenerateSchedule({s.schedule, s.pp, static_cast<int>(s.micro_batches), s.chunks}));
  PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(schedule), s.dp,
                                                       s.recompute, s.stage_boundaries));
  if (!s.stage_recompute.empty()) {
    run.recompute = s.stage_recompute;
  }
  run.tensor_parallel = s.tp;
  run.sequence_parallel = s.sequence_parallel;
  WorldOptions w;
  w.device = s.device;
  w.timeout = s.timeout;
  w.comm = s.comm;
  w.cuda_devices = s.cuda_devices;
  PW_ASSIGN_OR_RETURN(World world, World::InProcess(w));
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const Dataset> data,
                      OpenDataset(s.data, graph.shape().seq_len, s.train.seed));
  PW_ASSIGN_OR_RETURN(
      std::unique_ptr<Engine> engine,
      Engine::Create(graph, std::move(run), s.train, std::move(data), std::move(world)));
  PW_RETURN_IF_ERROR(engine->SetTestingHooks(s.hooks));
  return engine;
}

using WeightMap = std::map<std::string, std::vector<float>>;

inline WeightMap ToMap(const std::vector<std::pair<std::string, Tensor>>& named) {
  WeightMap m;
  for (const auto& [name, t] : named) m[name] = t.ToVector();
  return m;
}

// A run's per-step losses and final weights.
struct RunResult {
  std::vector<double> losses;
  WeightMap weights;
};

// Bit-identical losses and weights.
inline void ExpectSameRun(const RunResult& got, const RunResult& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  EXPECT_EQ(got.losses, want.losses) << what;
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  for (const auto& [name, w] : want.weights) {
    ASSERT_EQ(got.weights.count(name), 1u) << what << ": " << name << " missing";
    const std::vector<float>& v = got.weights.at(name);
    ASSERT_EQ(v.size(), w.size()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(v.data(), w.data(), w.size() * sizeof(float)), 0)
        << what << ": " << name << " differs";
  }
}

// What the parity tests train with: seed 7, a learning rate large enough that a wrong gradient
// shows up in the losses at once, one warm-up step.
inline TrainOptions ParityTrainOptions(int64_t steps) {
  TrainOptions o;
  o.steps = steps;
  o.seed = 7;
  o.lr = 1e-2f;
  o.warmup_steps = 1;
  return o;
}

// A `steps`-step run on pp x dp ranks with `micro_batches` per replica, ParityTrainOptions.
inline EngineSetup ParitySetup(int pp, int dp, ScheduleKind kind, int chunks, Recompute rc,
                               int64_t micro_batches, int64_t steps) {
  EngineSetup o;
  o.train = ParityTrainOptions(steps);
  o.micro_batches = micro_batches;
  o.pp = pp;
  o.dp = dp;
  o.schedule = kind;
  o.chunks = chunks;
  o.recompute = rc;
  o.timeout = absl::Seconds(30);
  return o;
}

// gpt-tiny's shape with the LM head tied to the embedding, 2 sequences per micro-batch.
inline GptConfig TiedTinyConfig() {
  return {.layers = 4, .hidden = 64, .heads = 4, .seq = 32, .vocab = 256, .tied = true};
}
inline LayerGraph TiedTiny() {
  auto g = GptModel("gpt-tiny-tied", TiedTinyConfig(), 2);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

// `steps` steps of a fresh engine: the losses and final weights; each step's report in
// `reports`, and `after` called with the engine when the steps are done.
inline RunResult RunSteps(const LayerGraph& g, const EngineSetup& o, int steps,
                          std::vector<StepReport>* reports = nullptr,
                          const std::function<void(Engine&)>& after = nullptr) {
  auto e = MakeEngine(g, o);
  EXPECT_TRUE(e.ok()) << e.status();
  RunResult r;
  if (!e.ok()) return r;
  for (int i = 0; i < steps; ++i) {
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    r.losses.push_back(s->result.loss);
    if (reports != nullptr) reports->push_back(*s);
  }
  r.weights = ToMap((*e)->Weights());
  if (after) after(**e);
  return r;
}

// The single-stage reference: the whole model on one CPU stage, micro-batch after micro-batch
// (forward, input backward, weight backward), the tied head's gradient added to the embedding's,
// per-layer squared norms summed in model order,
// clipping, the optimizer, the LR schedule — written directly against Stage, Optimizer and the
// data, independent of the engine's programs, executors and synchronization. fp32/bf16 only.
class ReferenceLoop {
 public:
  static absl::StatusOr<std::unique_ptr<ReferenceLoop>> Create(const LayerGraph& graph,
                                                               int64_t micro_batches,
                                                               const TrainOptions& o) {
    auto r = std::unique_ptr<ReferenceLoop>(new ReferenceLoop());
    r->options_ = o;
    r->layout_ = {micro_batches, graph.shape().batch, graph.shape().seq_len, 1};
    r->alloc_ = std::make_unique<CpuAllocator>();
    PW_ASSIGN_OR_RETURN(r->stage_,
                        graph.Instantiate(0, graph.num_layers(), o.seed, r->alloc_.get()));
    r->optimizer_ = Optimizer::Create(o.optimizer, r->stage_->Parameters(), r->alloc_.get());
    r->data_ = SyntheticDataset(graph.shape().seq_len, o.seed);
    r->lr_.peak = ScaleLearningRate(o.lr, r->layout_.global_batch(), o.base_batch, o.lr_scaling);
    r->lr_.warmup_steps = o.warmup_steps;
    r->lr_.total_steps = std::max<int64_t>(1, o.steps);
    r->lr_.min_ratio = o.min_lr_ratio;
    return r;
  }

  // One step; the mean loss over the batch.
  absl::StatusOr<double> Step() {
    StepBatch batch = MakeStepBatch(*data_, layout_, step_, 0);
    std::vector<Parameter*> params = stage_->Parameters();
    ZeroGrads(params);
    const int64_t M = layout_.micro_batches;
    Tensor dloss = Tensor::Empty({1}, DType::kF32, alloc_.get());
    dloss.data<float>()[0] = 1.0f / static_cast<float>(M);
    double loss_sum = 0;
    for (int64_t j = 0; j < M; ++j) {
      LayerContext ctx{alloc_.get(), &batch.targets[j], ComputeDType(options_.precision)};
      std::vector<Saved> saved;
      PW_ASSIGN_OR_RETURN(Tensor loss, stage_->Forward(batch.inputs[j], ctx, &saved));
      loss_sum += loss.data<float>()[0];
      PW_RETURN_IF_ERROR(stage_->BackwardInput(dloss, ctx, &saved).status());
      PW_RETURN_IF_ERROR(stage_->BackwardWeight(ctx, &saved));
    }
    PW_RETURN_IF_ERROR(AddTiedGradients(stage_->tied(), alloc_.get()));  // a tied LM head
    double norm2 = 0;
    for (int i = 0; i < stage_->size(); ++i) {
      PW_ASSIGN_OR_RETURN(double n2, GradSquaredNorm(stage_->layer(i).Parameters(), alloc_.get()));
      norm2 += n2;
    }
    const double norm = std::sqrt(norm2);
    PW_RETURN_IF_ERROR(ScaleGrads(params, ClipScale(norm, options_.clip_norm), alloc_.get()));
    PW_RETURN_IF_ERROR(optimizer_->Step(lr_.At(step_)));
    ++step_;
    return loss_sum / M;
  }

  std::vector<Parameter*> Parameters() const { return stage_->Parameters(); }

 private:
  ReferenceLoop() = default;
  TrainOptions options_;
  BatchLayout layout_;
  std::unique_ptr<CpuAllocator> alloc_;
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<TokenDataset> data_;
  LrSchedule lr_;
  int64_t step_ = 0;
};

// The single-stage reference's per-step losses and final weights over `steps` steps.
inline RunResult RunReference(const LayerGraph& g, int64_t micro_batches, const TrainOptions& o,
                              int steps) {
  auto t = ReferenceLoop::Create(g, micro_batches, o);
  EXPECT_TRUE(t.ok()) << t.status();
  RunResult r;
  if (!t.ok()) return r;
  for (int i = 0; i < steps; ++i) {
    auto s = (*t)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    r.losses.push_back(*s);
  }
  for (Parameter* p : (*t)->Parameters()) r.weights[p->name] = p->value.ToVector();
  return r;
}

}  // namespace pipewright::testing_util

#endif  // PIPEWRIGHT_TESTS_RUNTIME_ENGINE_UTIL_H_

// A custom model trained pipelined through the Engine, from a plan, on its own data — using only
// the installed public headers:
//
//   - a custom layer (ResidualMlp: y = x + fc2(gelu(fc1(x))), composed from built-in layers with
//     ChildInit so its parameters are named and initialised the same on any stage) and a custom
//     loss (MseLoss: mean squared error against f32 targets), both dispatching through
//     pipewright/ops.h so they run on whatever device the rank has;
//   - its own Dataset (TeacherDataset: imitate a fixed random network, f32 samples);
//   - a plan from the partitioner (pp = 2 x dp = 2, 1F1B), written to JSON and read back as a
//     user's plan file would be, run through RunSpecFromPlan;
//   - the numerics promise checked: the same steps on one stage (pp = 1, same data-parallel
//     width and micro-batching) give bit-identical losses.
//
// Exits 0 when the loss fell and the two runs agree bit for bit, 1 otherwise (a ctest entry).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/cpu.h"
#include "pipewright/engine.h"
#include "pipewright/init.h"
#include "pipewright/launch.h"
#include "pipewright/ops.h"
#include "pipewright/partitioner.h"
#include "pipewright/run_spec.h"

using namespace pipewright;

namespace {

constexpr int64_t kSeq = 16, kFeatures = 8, kWidth = 32, kHidden = 64;

// ---- A custom layer composed from built-in ones ----------------------------------------------

class ResidualMlp final : public Layer {
 public:
  ResidualMlp(std::unique_ptr<Layer> fc1, std::unique_ptr<Layer> act, std::unique_ptr<Layer> fc2) {
    parts_.push_back(std::move(fc1));
    parts_.push_back(std::move(act));
    parts_.push_back(std::move(fc2));
  }
  absl::string_view kind() const override { return "residual_mlp"; }

  // One Saved child per part; y = x + the parts' output.
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override {
    saved->children.resize(parts_.size());
    Tensor h = x;
    for (size_t i = 0; i < parts_.size(); ++i) {
      PW_ASSIGN_OR_RETURN(h, parts_[i]->Forward(h, ctx, &saved->children[i]));
    }
    return ops::Add(ops::ExecOf(ctx), x, h);
  }
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override {
    if (saved->children.size() != parts_.size()) {
      return absl::FailedPreconditionError("residual_mlp: backward without a forward");
    }
    Tensor g = dy;
    for (size_t i = parts_.size(); i-- > 0;) {
      PW_ASSIGN_OR_RETURN(g, parts_[i]->BackwardInput(g, ctx, &saved->children[i]));
    }
    return ops::Add(ops::ExecOf(ctx), dy, g);  // the residual path adds dy
  }
  absl::Status BackwardWeight(const LayerContext& ctx, Saved* saved) override {
    for (size_t i = parts_.size(); i-- > 0;) {
      PW_RETURN_IF_ERROR(parts_[i]->BackwardWeight(ctx, &saved->children[i]));
    }
    saved->Clear();
    return absl::OkStatus();
  }
  std::vector<Parameter*> Parameters() override {
    std::vector<Parameter*> out;
    for (auto& p : parts_) {
      for (Parameter* q : p->Parameters()) out.push_back(q);
    }
    return out;
  }

 private:
  std::vector<std::unique_ptr<Layer>> parts_;
};

class ResidualMlpSpec final : public LayerSpec {
 public:
  ResidualMlpSpec(int64_t dim, int64_t hidden)
      : fc1_(layers::Linear(dim, hidden)),
        act_(layers::Gelu()),
        fc2_(layers::Linear(hidden, dim)) {}
  std::string kind() const override { return "residual_mlp"; }
  Cost GetCost(const MicroBatchShape& shape, int64_t input_bytes) const override {
    Cost c = fc1_->GetCost(shape, input_bytes);
    c += act_->GetCost(shape, c.output_bytes);
    c += fc2_->GetCost(shape, c.output_bytes);
    c.forward_flops += static_cast<double>(input_bytes / 4);  // the residual add
    return c;
  }
  absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext& init) const override {
    // ChildInit names the parts' parameters "<node>.fc1.weight", ...: global, stable, the same
    // on every stage.
    PW_ASSIGN_OR_RETURN(auto fc1, fc1_->Create(ChildInit(init, "fc1")));
    PW_ASSIGN_OR_RETURN(auto act, act_->Create(ChildInit(init, "act")));
    PW_ASSIGN_OR_RETURN(auto fc2, fc2_->Create(ChildInit(init, "fc2")));
    return std::unique_ptr<Layer>(new ResidualMlp(std::move(fc1), std::move(act), std::move(fc2)));
  }
  std::string Config() const override {
    return absl::StrCat("fc1=(", fc1_->Config(), "),fc2=(", fc2_->Config(), ")");
  }

 private:
  LayerSpecPtr fc1_, act_, fc2_;
};

// ---- A custom loss ------------------------------------------------------------------------------
// Like every loss layer: the last stage's Forward returns the loss as a host f32 [1] tensor, and
// BackwardInput receives a host f32 [1] gradient scale.

class MseLoss final : public Layer {
 public:
  absl::string_view kind() const override { return "mse_loss"; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved* saved) override {
    if (ctx.targets == nullptr || ctx.targets->shape() != x.shape() ||
        ctx.targets->dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mse_loss: targets must be f32 of the prediction's shape ", x.ShapeString()));
    }
    const ops::Exec e = ops::ExecOf(ctx);
    Tensor diff = Tensor::Empty(x.shape(), DType::kF32, AllocatorOf(ctx));
    PW_RETURN_IF_ERROR(ops::Copy(e, *ctx.targets, diff));
    PW_RETURN_IF_ERROR(ops::Scale(e, diff, -1.0f));
    PW_RETURN_IF_ERROR(ops::AddInPlace(e, diff, x));  // diff = x - target
    PW_ASSIGN_OR_RETURN(double sum, ops::SumSquares(e, {&diff}));
    Tensor loss = Tensor::Empty({1}, DType::kF32);
    loss.data<float>()[0] = static_cast<float>(sum / static_cast<double>(x.numel()));
    saved->tensors = {std::move(diff)};
    return loss;
  }
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx,
                                       Saved* saved) override {
    if (saved->tensors.size() != 1) return absl::FailedPreconditionError("mse_loss: no forward");
    Tensor dx = std::move(saved->tensors[0]);  // d/dx mean((x - t)^2) = 2 (x - t) / n
    const float g = dy.defined() ? dy.data<float>()[0] : 1.0f;
    PW_RETURN_IF_ERROR(ops::Scale(ops::ExecOf(ctx), dx, 2.0f * g / static_cast<float>(dx.numel())));
    saved->Clear();
    return dx;
  }
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }
};

class MseLossSpec final : public LayerSpec {
 public:
  std::string kind() const override { return "mse_loss"; }
  Cost GetCost(const MicroBatchShape&, int64_t input_bytes) const override {
    Cost c;
    c.forward_flops = c.backward_flops = 3.0 * static_cast<double>(input_bytes / 4);
    c.activation_bytes = input_bytes;
    c.output_bytes = 4;
    return c;
  }
  absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext&) const override {
    return std::unique_ptr<Layer>(new MseLoss());
  }
  std::string Config() const override { return ""; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>&) const override { return {1}; }
};

// ---- Its own data -------------------------------------------------------------------------------

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
float Uniform(uint64_t key) { return static_cast<float>(Mix(key) >> 40) / 16777216.0f; }

// A teacher to imitate: sample i is kSeq positions of kFeatures inputs drawn uniformly from
// [-1, 1], and the targets are a fixed random network of them at the same position,
// target[t] = tanh(W x[t]) with W drawn from the seed.
class TeacherDataset final : public Dataset {
 public:
  explicit TeacherDataset(uint64_t seed) : seed_(seed) {}
  std::string Describe() const override { return "teacher (f32 regression)"; }
  SampleSpec Spec() const override {
    return {{kSeq, kFeatures}, DType::kF32, {kSeq, kFeatures}, DType::kF32};
  }
  void Sample(int64_t index, void* input, void* target) const override {
    const uint64_t key = Mix(seed_ ^ Mix(static_cast<uint64_t>(index)));
    auto* in = static_cast<float*>(input);
    auto* tg = static_cast<float*>(target);
    for (int64_t i = 0; i < kSeq * kFeatures; ++i) in[i] = 2 * Uniform(key + i) - 1;
    for (int64_t t = 0; t < kSeq; ++t) {
      for (int64_t f = 0; f < kFeatures; ++f) {
        float z = 0;
        for (int64_t g = 0; g < kFeatures; ++g) {
          z += (2 * Uniform(Mix(seed_) + f * kFeatures + g) - 1) * in[t * kFeatures + g];
        }
        tg[t * kFeatures + f] = std::tanh(z);
      }
    }
  }

 private:
  uint64_t seed_;
};

absl::StatusOr<LayerGraph> StudentModel() {
  ModelBuilder b("teacher-mlp", {.batch = 4, .seq_len = kSeq});
  b.Add("in", layers::Linear(kFeatures, kWidth));
  for (int i = 0; i < 4; ++i) {
    b.Add(absl::StrCat("blocks.", i), std::make_shared<ResidualMlpSpec>(kWidth, kHidden));
  }
  b.Add("out", layers::Linear(kWidth, kFeatures));
  b.Add("loss", std::make_shared<MseLossSpec>());
  return b.Build();
}

absl::StatusOr<std::vector<double>> Train(const LayerGraph& graph, RunSpec run, int steps) {
  TrainOptions o;
  o.steps = steps;
  o.seed = 3;
  o.lr = 1e-2f;
  o.warmup_steps = 2;
  PW_ASSIGN_OR_RETURN(World world, World::InProcess({}));
  PW_ASSIGN_OR_RETURN(auto engine,
                      Engine::Create(graph, std::move(run), o, std::make_shared<TeacherDataset>(11),
                                     std::move(world)));
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    PW_ASSIGN_OR_RETURN(StepReport r, engine->Step());
    losses.push_back(r.result.loss);
  }
  return losses;
}

absl::Status Run() {
  SetCpuKernelThreads(1);
  PW_ASSIGN_OR_RETURN(LayerGraph graph, StudentModel());

  // The partitioner's plan for 4 devices, as JSON (what `pipewright plan -o` writes), read back
  // and validated against the model like a user's plan file.
  const ModelCosts costs = ToModelCosts(graph);
  DeviceSpec devices;
  devices.count = 4;
  devices.memory_bytes = int64_t{1} << 30;
  PartitionOptions po;
  po.pp = 2;
  po.dp = 2;
  po.schedule = ScheduleKind::k1F1B;
  po.micro_batches = 4;
  PW_ASSIGN_OR_RETURN(Plan planned, Partition(costs, devices, po));
  PW_ASSIGN_OR_RETURN(Plan plan, PlanFromJson(PlanToJson(planned), &costs));
  std::printf("plan: pp=%d dp=%d %s, stages", plan.pipeline_parallel, plan.data_parallel,
              ScheduleKindName(plan.schedule.kind));
  for (const PlanStage& s : plan.stages) std::printf(" [%d, %d)", s.begin, s.end);
  std::printf("\n");

  constexpr int kSteps = 40;
  PW_ASSIGN_OR_RETURN(RunSpec pipelined, RunSpecFromPlan(plan));
  PW_ASSIGN_OR_RETURN(std::vector<double> losses, Train(graph, std::move(pipelined), kSteps));
  // The same global batch on one stage per replica.
  PW_ASSIGN_OR_RETURN(Schedule one, GenerateSchedule({ScheduleKind::k1F1B, 1, 4, 1}));
  PW_ASSIGN_OR_RETURN(RunSpec single, RunSpecFromSchedule(graph, std::move(one), 2));
  PW_ASSIGN_OR_RETURN(std::vector<double> reference, Train(graph, std::move(single), kSteps));

  for (int i = 0; i < kSteps; i += 5) std::printf("step %2d  mse %.5f\n", i, losses[i]);
  std::printf("step %2d  mse %.5f\n", kSteps - 1, losses.back());
  if (!(losses.back() < 0.5 * losses.front())) {
    return absl::InternalError(
        absl::StrCat("the loss did not fall: ", losses.front(), " -> ", losses.back()));
  }
  for (int i = 0; i < kSteps; ++i) {
    if (losses[i] != reference[i]) {
      return absl::InternalError(absl::StrCat("step ", i, ": pp=2 loss ", losses[i],
                                              " differs from the single stage's ", reference[i]));
    }
  }
  std::printf("pp=2 x dp=2 losses are bit-identical to pp=1 x dp=2 over %d steps\n", kSteps);
  return absl::OkStatus();
}

}  // namespace

int main() {
  absl::Status s = Run();
  if (!s.ok()) {
    std::fprintf(stderr, "custom_pipeline: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

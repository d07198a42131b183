#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "pipewright/checkpoint.h"
#include "pipewright/train.h"
#include "runtime/train_state.h"

namespace pipewright {

using json = nlohmann::json;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const LayerGraph& graph,
                                                         const TrainOptions& options) {
  if (options.micro_batches < 1) return absl::InvalidArgumentError("--micro-batches must be >= 1");
  if (options.steps < 0) return absl::InvalidArgumentError("--steps must be >= 0");
  if (!(options.lr > 0) || !std::isfinite(options.lr)) {
    return absl::InvalidArgumentError("--lr must be a positive number");
  }
  if (options.precision == Precision::kFp16) {
    PW_RETURN_IF_ERROR(LossScaler::Validate(options.loss_scale));
  }
  std::unique_ptr<Trainer> t(new Trainer());
  if (options.precision == Precision::kFp16) t->scaler_ = LossScaler(options.loss_scale);
  t->graph_ = graph;
  t->options_ = options;
  t->layout_ = {options.micro_batches, graph.shape().batch, graph.shape().seq_len, 1};
  t->allocator_ = std::make_unique<CpuAllocator>();
  PW_ASSIGN_OR_RETURN(t->stage_,
                      graph.Instantiate(0, graph.num_layers(), options.seed, t->allocator_.get()));
  t->optimizer_ =
      Optimizer::Create(options.optimizer, t->stage_->Parameters(), t->allocator_.get());
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Dataset> data,
                      OpenDataset(options.data, graph.shape().seq_len, options.seed));
  t->data_ = std::move(data);
  t->schedule_.peak = ScaleLearningRate(options.lr, t->layout_.global_batch(), options.base_batch,
                                        options.lr_scaling);
  t->schedule_.warmup_steps = options.warmup_steps;
  t->schedule_.total_steps = std::max<int64_t>(1, options.steps);
  t->schedule_.min_ratio = options.min_lr_ratio;
  return t;
}

Trainer::~Trainer() = default;

float Trainer::PeakLr() const { return schedule_.peak; }
int64_t Trainer::peak_memory_bytes() const { return allocator_->peak_bytes(); }
int64_t Trainer::current_memory_bytes() const { return allocator_->current_bytes(); }
std::vector<Parameter*> Trainer::Parameters() const { return stage_->Parameters(); }

absl::StatusOr<StepResult> Trainer::Step() {
  if (loader_ == nullptr) loader_ = std::make_unique<DataLoader>(data_, layout_, 0, step_);
  absl::Time start = absl::Now();
  absl::Duration wait_before = loader_->wait_time();
  StepBatch batch = loader_->Next();
  PW_CHECK(batch.step == step_);
  std::vector<Parameter*> params = stage_->Parameters();
  ZeroGrads(params);

  const int64_t M = layout_.micro_batches;
  Tensor dloss = Tensor::Empty({1}, DType::kF32, allocator_.get());
  const float scale = scaler_.scale();
  dloss.data<float>()[0] = scale / static_cast<float>(M);
  double loss_sum = 0;
  for (int64_t j = 0; j < M; ++j) {
    LayerContext ctx{allocator_.get(), &batch.targets[j], ComputeDType(options_.precision)};
    std::vector<Saved> saved;
    PW_ASSIGN_OR_RETURN(Tensor loss, stage_->Forward(batch.inputs[j], ctx, &saved));
    float l = loss.data<float>()[0];
    if (!std::isfinite(l) && !scaler_.enabled()) {
      return absl::InternalError(absl::StrCat("step ", step_, ": non-finite loss ", l,
                                              " on micro-batch ", j, "; weights not updated"));
    }
    loss_sum += l;
    PW_RETURN_IF_ERROR(stage_->BackwardInput(dloss, ctx, &saved).status());
    PW_RETURN_IF_ERROR(stage_->BackwardWeight(ctx, &saved));
  }
  // Summed per layer, then over layers in model order: the same grouping the pipeline engine
  // uses across stages, so both give bit-identical norms.
  double norm2 = 0;
  for (int i = 0; i < stage_->size(); ++i) {
    PW_ASSIGN_OR_RETURN(double layer_norm2,
                        GradSquaredNorm(stage_->layer(i).Parameters(), allocator_.get()));
    norm2 += layer_norm2;
  }
  double norm = std::sqrt(norm2) / scale;
  const bool finite = std::isfinite(norm) && std::isfinite(loss_sum);
  const bool apply = scaler_.Update(finite);
  if (apply && !finite) {
    return absl::InternalError(
        absl::StrCat("step ", step_, ": non-finite gradient norm; weights not updated"));
  }
  float lr = schedule_.At(step_);
  if (apply) {
    PW_RETURN_IF_ERROR(
        ScaleGrads(params, ClipScale(norm, options_.clip_norm) / scale, allocator_.get()));
    PW_RETURN_IF_ERROR(optimizer_->Step(lr));
  }

  StepResult r;
  r.loss_scale = scale;
  r.skipped = !apply;
  r.step = step_;
  r.loss = loss_sum / M;
  r.lr = lr;
  r.grad_norm = norm;
  r.step_time_s = absl::ToDoubleSeconds(absl::Now() - start);
  r.samples_per_s = r.step_time_s > 0 ? layout_.global_batch() / r.step_time_s : 0;
  r.data_wait_s = absl::ToDoubleSeconds(loader_->wait_time() - wait_before);
  ++step_;
  return r;
}

absl::Status Trainer::Save(const std::string& dir) const {
  internal::ManifestInfo info;
  info.graph = &graph_;
  info.options = &options_;
  info.layout = layout_;
  info.step = step_;
  info.optimizer_step = optimizer_->step_count();
  info.lr = schedule_;
  info.scaler = &scaler_;
  NamedTensors model, opt;
  for (Parameter* p : stage_->Parameters()) model.emplace_back(p->name, p->value);
  for (auto& [name, t] : optimizer_->State()) opt.emplace_back(name, t);
  return WriteCheckpoint(dir, internal::BuildManifest(info), model, opt);
}

absl::Status Trainer::Resume(const std::string& dir) {
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir, allocator_.get()));
  PW_ASSIGN_OR_RETURN(
      internal::ResumePoint at,
      internal::CheckManifest(dir, ck.manifest_json, graph_, layout_, options_.optimizer.kind));
  std::vector<Parameter*> params = stage_->Parameters();
  // Validate every tensor before touching the weights or the optimizer.
  PW_RETURN_IF_ERROR(internal::CheckParameters(dir, ck.model, params));
  PW_RETURN_IF_ERROR(optimizer_->LoadState(ck.optimizer, at.optimizer_step));
  internal::CopyParameters(ck.model, params);
  internal::RestoreLossScaler(at, &scaler_);
  step_ = at.step;
  loader_.reset();  // restarts at the checkpoint's data position
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const std::string& dir, const std::string& data,
                                              int64_t batches) {
  if (batches < 1) return absl::InvalidArgumentError("--batches must be >= 1");
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir));
  json m = json::parse(ck.manifest_json, nullptr, false);
  if (m.is_discarded() || !m.contains("model") || !m["model"].contains("preset")) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/manifest.json: model.preset missing"));
  }
  std::string preset = m["model"].value("preset", "");
  int64_t mbs = m["model"].value("micro_batch_size", int64_t{0});
  PW_ASSIGN_OR_RETURN(LayerGraph graph, PresetModel(preset, mbs));
  if (m["model"].value("fingerprint", "") != graph.Fingerprint()) {
    return absl::InvalidArgumentError(absl::StrCat(dir,
                                                   "/manifest.json: fingerprint does not "
                                                   "match preset '",
                                                   preset, "'"));
  }
  PW_ASSIGN_OR_RETURN(auto stage, graph.Instantiate(0, graph.num_layers(), 0));
  for (Parameter* p : stage->Parameters()) {
    auto it = ck.model.find(p->name);
    if (it == ck.model.end() || it->second.shape() != p->value.shape()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/model.safetensors: tensor '", p->name, "' missing or misshapen"));
    }
    std::copy_n(it->second.data<float>(), it->second.numel(), p->value.data<float>());
  }
  uint64_t seed = m.contains("rng") ? m["rng"].value("seed", uint64_t{0}) : 0;
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Dataset> ds, OpenDataset(data, graph.shape().seq_len, seed));
  BatchLayout layout{1, graph.shape().batch, graph.shape().seq_len, 1};
  constexpr int64_t kHeldOutStep = int64_t{1} << 40;  // far from any training step
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    StepBatch b = MakeStepBatch(*ds, layout, kHeldOutStep / layout.global_batch() + i, 0);
    LayerContext ctx{nullptr, &b.targets[0]};
    std::vector<Saved> saved;
    PW_ASSIGN_OR_RETURN(Tensor loss, stage->Forward(b.inputs[0], ctx, &saved));
    sum += loss.data<float>()[0];
  }
  EvalResult r;
  r.loss = sum / batches;
  r.perplexity = std::exp(r.loss);
  r.tokens = batches * layout.global_batch() * layout.seq_len;
  r.model = graph.name();
  r.step = m.value("step", int64_t{0});
  return r;
}

}  // namespace pipewright

// What the gradient synchronizations share (grad_sync.h).
#include "runtime/grad_sync/grad_sync.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "pipewright/ops.h"

namespace pipewright::internal {

StageBuckets BucketLayers(const GradSyncStage& stage, int64_t bucket_bytes) {
  StageBuckets sb;
  sb.layer_bucket.assign(stage.layers.size(), -1);
  int64_t bytes = 0;
  for (size_t i = stage.layers.size(); i-- > 0;) {
    if (stage.layers[i].empty()) continue;
    if (sb.params.empty() || bytes >= bucket_bytes) {
      sb.params.emplace_back();
      sb.layers.push_back(0);
      bytes = 0;
    }
    for (Parameter* p : stage.layers[i]) {
      sb.params.back().push_back(p);
      bytes += static_cast<int64_t>(p->grad.nbytes());
    }
    ++sb.layers.back();
    sb.layer_bucket[i] = static_cast<int>(sb.params.size()) - 1;
  }
  return sb;
}

int64_t RingAllReduceBytes(int64_t bytes, int n) {
  return n <= 1 ? 0 : 2 * (bytes / n) * (n - 1) + 2 * (bytes % n) * (n - 1) / n;
}

int64_t RingReduceScatterBytes(int64_t bytes, int n) {
  return n <= 1 ? 0 : (bytes / n) * (n - 1) + (bytes % n) * (n - 1) / n;
}

int64_t RingAllGatherBytes(int64_t bytes, int n) { return n <= 1 ? 0 : bytes * (n - 1); }

BucketLauncher::BucketLauncher(Communicator* dp, const std::vector<GradSyncStage>& stages,
                               int64_t bucket_bytes)
    : dp_(dp) {
  for (const GradSyncStage& s : stages) {
    groupings_.push_back(BucketLayers(s, bucket_bytes));
    pending_.emplace_back(groupings_.back().layers.size(), 0);
    launched_.emplace_back(groupings_.back().layers.size(), 0);
  }
}

void BucketLauncher::BeginStep() {
  for (size_t s = 0; s < groupings_.size(); ++s) {
    pending_[s] = groupings_[s].layers;
    std::fill(launched_[s].begin(), launched_[s].end(), 0);
  }
  ResetStep();
}

absl::Status BucketLauncher::Launch(int stage, int bucket) {
  launched_[stage][bucket] = 1;
  return LaunchBucket(stage, bucket);
}

absl::Status BucketLauncher::LayerReady(int stage, int layer) {
  if (dp_ == nullptr) return absl::OkStatus();
  const int b = groupings_[stage].layer_bucket[layer];
  if (b < 0) return absl::OkStatus();
  if (--pending_[stage][b] == 0) return Launch(stage, b);
  return absl::OkStatus();
}

absl::Status BucketLauncher::StageReady(int stage) {
  if (dp_ == nullptr) return absl::OkStatus();
  for (size_t b = 0; b < launched_[stage].size(); ++b) {
    if (!launched_[stage][b]) PW_RETURN_IF_ERROR(Launch(stage, static_cast<int>(b)));
  }
  return absl::OkStatus();
}

absl::StatusOr<const Tensor*> FindState(const std::map<std::string, Tensor>& state,
                                        const std::string& prefix, const std::string& name,
                                        const std::vector<int64_t>& shape) {
  const std::string key = prefix + name;
  auto it = state.find(key);
  if (it == state.end()) {
    return absl::NotFoundError(absl::StrCat("gradient-compression state '", key, "' missing"));
  }
  if (it->second.dtype() != DType::kF32 || it->second.shape() != shape) {
    Tensor want = Tensor::Empty(shape, DType::kF32);
    return absl::InvalidArgumentError(absl::StrCat("gradient-compression state '", key,
                                                   "' has shape ", it->second.ShapeString(),
                                                   ", expected ", want.ShapeString()));
  }
  return &it->second;
}

absl::Status SaveFlat(const Tensor& flat, const std::vector<Parameter*>& params,
                      const std::string& what, NamedTensors* out) {
  Tensor host_flat;
  if (flat.defined()) {
    PW_ASSIGN_OR_RETURN(host_flat, flat.CopyTo(nullptr));
  }
  int64_t offset = 0;
  for (Parameter* p : params) {
    Tensor host = Tensor::Empty(p->grad.shape(), DType::kF32);
    if (flat.defined()) {
      PW_RETURN_IF_ERROR(ops::CopyRange(ops::Exec{}, host_flat, offset, host, 0, host.numel()));
    } else {
      host.SetZero();
    }
    offset += host.numel();
    out->emplace_back(absl::StrCat(what, ".", p->name), std::move(host));
  }
  return absl::OkStatus();
}

absl::Status LoadFlat(const std::map<std::string, Tensor>& state, const std::string& prefix,
                      const std::string& what, const std::vector<Parameter*>& params,
                      Allocator* alloc, Tensor* flat) {
  std::vector<const Tensor*> parts;
  int64_t numel = 0;
  for (Parameter* p : params) {
    PW_ASSIGN_OR_RETURN(const Tensor* t, FindState(state, prefix, absl::StrCat(what, ".", p->name),
                                                   p->grad.shape()));
    parts.push_back(t);
    numel += t->numel();
  }
  Tensor host = Tensor::Empty({numel}, DType::kF32);
  int64_t offset = 0;
  for (const Tensor* t : parts) {
    Tensor h = *t;
    if (t->device().is_cuda()) {
      PW_ASSIGN_OR_RETURN(h, t->CopyTo(nullptr));
    }
    PW_RETURN_IF_ERROR(ops::CopyRange(ops::Exec{}, h, 0, host, offset, h.numel()));
    offset += h.numel();
  }
  PW_ASSIGN_OR_RETURN(*flat, host.CopyTo(alloc));
  return absl::OkStatus();
}

}  // namespace pipewright::internal

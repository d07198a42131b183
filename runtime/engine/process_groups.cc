// ProcessGroups (process_groups.h).
#include "runtime/engine/process_groups.h"

#include "absl/strings/str_cat.h"
#include "pipewright/status.h"

namespace pipewright::internal {

absl::Status ProcessGroups::Connect(const Topology& topo, int global, const GroupNeeds& needs,
                                    absl::Duration timeout) {
  if (world_ == nullptr) return absl::FailedPreconditionError("process groups without a world");
  const int pipe = topo.PipelineRank(global), replica = topo.Replica(global);
  const int tensor = topo.TensorRank(global), T = topo.tp;
  // Note [Process groups]: the same splits in the same order on every rank. Every group but the
  // tensor-parallel one joins ranks of one tensor-parallel rank (the same part of the layers).
  if (topo.dp > 1) {
    PW_ASSIGN_OR_RETURN(data_parallel_, world_->Split(pipe * T + tensor, replica, timeout));
  }
  ties_.clear();
  for (const auto& [a, b] : needs.tie_pairs) {
    const bool member = pipe == a || pipe == b;
    PW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                        world_->Split(member ? replica * T + tensor : -1, pipe, timeout));
    ties_.push_back(std::move(c));
  }
  if (needs.pipeline && topo.pp > 1) {
    PW_ASSIGN_OR_RETURN(pipeline_, world_->Split(replica * T + tensor, pipe, timeout));
  }
  if (T > 1) {
    PW_ASSIGN_OR_RETURN(tensor_parallel_, world_->Split(replica * topo.pp + pipe, tensor, timeout));
  }
  return absl::OkStatus();
}

void ProcessGroups::ResetGroups() {
  tensor_parallel_.reset();
  pipeline_.reset();
  ties_.clear();
  data_parallel_.reset();
}

}  // namespace pipewright::internal

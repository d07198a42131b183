// The helpers the data-parallel strategies share (data_parallel.h).
#include "runtime/data_parallel/data_parallel.h"

#include <utility>

namespace pipewright::internal {

absl::Status AppendHostState(const Optimizer& optimizer, NamedTensors* out) {
  for (auto& [name, t] : optimizer.State()) {
    PW_ASSIGN_OR_RETURN(Tensor h, t.CopyTo(nullptr));
    out->emplace_back(name, std::move(h));
  }
  return absl::OkStatus();
}

absl::Status AddWholeSquaredNorm(const std::vector<GradSyncStage>& stages, Allocator* exec,
                                 int tensor_rank, ExactSum* sum) {
  const ops::Exec e{exec};
  for (const GradSyncStage& st : stages) {
    for (const std::vector<Parameter*>& layer : st.layers) {
      for (const Parameter* p : layer) {
        if (!CountsInNorm(*p, tensor_rank)) continue;
        PW_RETURN_IF_ERROR(AddChunkSquares(e, p->grad, 0, p->grad.numel(), sum));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright::internal

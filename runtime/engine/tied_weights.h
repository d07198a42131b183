// The tied weights of one rank, as one component (internal): which of its parameters are tied
// copies linked to an owner on this rank, which are one end of a tie whose other end is on
// another pipeline rank of the replica, and the reduction that makes every tied gradient
// owner + copy after the data-parallel one (Note [Tied parameters] in runtime/model.cc).
#ifndef PIPEWRIGHT_RUNTIME_ENGINE_TIED_WEIGHTS_H_
#define PIPEWRIGHT_RUNTIME_ENGINE_TIED_WEIGHTS_H_

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/comm.h"
#include "pipewright/model.h"
#include "pipewright/run_spec.h"
#include "runtime/engine/process_groups.h"

namespace pipewright::internal {

// A tied weight whose owner and copy are on different pipeline ranks.
struct CrossRankTie {
  std::string owner;  // the owner parameter's global name
  int owner_pipe = 0, copy_pipe = 0;
};

// The run's ties across pipeline ranks, in layer order (the same on every rank).
std::vector<CrossRankTie> CrossRankTies(const LayerGraph& graph, const RunSpec& run);

// The pairs of pipeline ranks (lower first) that share a tied weight, each once, in the order of
// `ties`: GroupNeeds::tie_pairs, so that the k-th embedding group serves the k-th pair.
std::vector<std::pair<int, int>> TiePairs(const std::vector<CrossRankTie>& ties);

class TiedWeights {
 public:
  // Links the tied copies of a rank's stages: `within` are the links each stage made itself
  // (Stage::tied()), and copies whose owner is in another of the rank's stages (V schedules put
  // the first and last stage on one rank) are linked here. `*trained` becomes the parameters the
  // rank trains: `all` less those linked copies.
  static absl::StatusOr<TiedWeights> Link(std::vector<TiedLink> within,
                                          const std::vector<Parameter*>& all,
                                          std::vector<Parameter*>* trained);

  // This rank's end of every tie across ranks (`pipe` is the rank's pipeline rank), found among
  // `trained`, each reduced over its embedding group `groups.tie(k)`. `who` names the rank.
  absl::Status LinkRemote(int pipe, const std::vector<CrossRankTie>& ties,
                          const std::vector<Parameter*>& trained, const ProcessGroups& groups,
                          const std::string& who);

  // Every parameter that is one end of a tie (a data-parallel strategy keeps them whole).
  void AddTo(std::set<const Parameter*>* tied) const;

  // After the data-parallel reduction: every linked copy's gradient is added to its owner's
  // (and zeroed); every tie across ranks is all-reduced over its group, each end then holding
  // owner + copy. `wait` waits for a collective, naming it.
  using WaitFn = std::function<absl::Status(Work&, const std::string&)>;
  absl::Status Reduce(Allocator* exec, const WaitFn& wait) const;
  // Whether Reduce communicates (a tie across ranks ends on this rank).
  bool communicates() const { return !remote_.empty(); }

 private:
  struct Remote {
    Parameter* param = nullptr;     // this rank's owner or copy
    Communicator* group = nullptr;  // the replica's two ranks holding it
  };
  std::vector<TiedLink> local_;
  std::vector<Remote> remote_;
};

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_ENGINE_TIED_WEIGHTS_H_

// The communicators one rank needs, as one component (internal): its world communicator and
// every group split off it — its stage's data-parallel group, the embedding (tie) groups of the
// pipeline ranks that share a tied weight, its replica's pipeline group and its tensor-parallel
// group — made from the run's Topology (pp, dp, tp).
//
// Note [Process groups]. Communicator::Split is collective over the world: every world rank
// calls it, in the same order, with a colour (-1: not a member) and a key (its rank in the new
// group). Connect makes the splits in one fixed order on every rank, so the engine never
// orders collectives by hand, and the k-th split of every rank is the same group. Each group's
// size comes from the Topology, which is the only place the parallel sizes live in the engine.
#ifndef PIPEWRIGHT_RUNTIME_ENGINE_PROCESS_GROUPS_H_
#define PIPEWRIGHT_RUNTIME_ENGINE_PROCESS_GROUPS_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"

namespace pipewright::internal {

// Which groups a run needs besides the world.
struct GroupNeeds {
  // Pairs of pipeline ranks (lower first) that share a tied weight: one embedding group each.
  std::vector<std::pair<int, int>> tie_pairs;
  // The replica's pipeline group (asynchronous DP agrees on each step within a replica).
  bool pipeline = false;
};

class ProcessGroups {
 public:
  ProcessGroups() = default;
  explicit ProcessGroups(std::unique_ptr<Communicator> world) : world_(std::move(world)) {}

  // Splits every group this rank needs off the world (collective: every world rank calls it
  // at once, with the same topology and needs). `global` is this rank's world rank.
  absl::Status Connect(const Topology& topo, int global, const GroupNeeds& needs,
                       absl::Duration timeout);

  Communicator* world() const { return world_.get(); }
  // The stage's data-parallel group (group rank = replica; the ranks of the same pipeline and
  // tensor-parallel rank in every replica); null when dp = 1.
  Communicator* data_parallel() const { return data_parallel_.get(); }
  // The replica's pipeline group (group rank = pipeline rank), when asked for; else null.
  Communicator* pipeline() const { return pipeline_.get(); }
  // The ranks that split the same layers (group rank = tensor-parallel rank); null when tp = 1.
  Communicator* tensor_parallel() const { return tensor_parallel_.get(); }
  // The embedding group of needs.tie_pairs[k] (group rank: the pair's order), or null when this
  // rank is in neither pipeline rank of the pair.
  Communicator* tie(size_t k) const { return k < ties_.size() ? ties_[k].get() : nullptr; }

  // Destroys the split groups, then (ResetWorld) the world: the engine tears every rank's
  // groups down before any rank's world, and both before the allocators their buffers use.
  void ResetGroups();
  void ResetWorld() { world_.reset(); }

 private:
  std::unique_ptr<Communicator> world_, data_parallel_, pipeline_, tensor_parallel_;
  std::vector<std::unique_ptr<Communicator>> ties_;  // per tie pair; null where not a member
};

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_ENGINE_PROCESS_GROUPS_H_

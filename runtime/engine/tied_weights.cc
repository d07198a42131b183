// The tied weights of one rank (tied_weights.h).
#include "runtime/engine/tied_weights.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "pipewright/status.h"

namespace pipewright::internal {

std::vector<CrossRankTie> CrossRankTies(const LayerGraph& graph, const RunSpec& run) {
  auto pipe_of = [&](int layer) {
    for (int s = 0; s < run.num_stages(); ++s) {
      if (layer < run.boundaries[s + 1]) return run.schedule.stage_rank[s];
    }
    return -1;
  };
  std::vector<CrossRankTie> ties;
  for (int i = 0; i < graph.num_layers(); ++i) {
    const LayerSpec& spec = *graph.node(i).spec;
    if (spec.tied_parameter().empty()) continue;
    for (int o = 0; o < i; ++o) {
      if (graph.node(o).name != spec.tied_to()) continue;
      if (pipe_of(o) != pipe_of(i)) ties.push_back({spec.tied_parameter(), pipe_of(o), pipe_of(i)});
    }
  }
  return ties;
}

namespace {

std::pair<int, int> PipePair(const CrossRankTie& t) {
  return {std::min(t.owner_pipe, t.copy_pipe), std::max(t.owner_pipe, t.copy_pipe)};
}

}  // namespace

std::vector<std::pair<int, int>> TiePairs(const std::vector<CrossRankTie>& ties) {
  std::vector<std::pair<int, int>> pairs;
  for (const CrossRankTie& t : ties) {
    if (std::find(pairs.begin(), pairs.end(), PipePair(t)) == pairs.end()) {
      pairs.push_back(PipePair(t));
    }
  }
  return pairs;
}

absl::StatusOr<TiedWeights> TiedWeights::Link(std::vector<TiedLink> within,
                                              const std::vector<Parameter*>& all,
                                              std::vector<Parameter*>* trained) {
  TiedWeights t;
  t.local_ = std::move(within);
  PW_ASSIGN_OR_RETURN(std::vector<TiedLink> across, LinkTiedParameters(all));
  trained->clear();
  for (Parameter* p : all) {
    bool linked = false;
    for (const TiedLink& l : across) linked = linked || l.copy == p;
    if (!linked) trained->push_back(p);
  }
  t.local_.insert(t.local_.end(), across.begin(), across.end());
  return t;
}

absl::Status TiedWeights::LinkRemote(int pipe, const std::vector<CrossRankTie>& ties,
                                     const std::vector<Parameter*>& trained,
                                     const ProcessGroups& groups, const std::string& who) {
  const std::vector<std::pair<int, int>> pairs = TiePairs(ties);
  for (const CrossRankTie& t : ties) {
    if (pipe != t.owner_pipe && pipe != t.copy_pipe) continue;
    const size_t k = std::find(pairs.begin(), pairs.end(), PipePair(t)) - pairs.begin();
    Parameter* mine = nullptr;
    for (Parameter* p : trained) {
      if (pipe == t.owner_pipe ? p->name == t.owner && p->tied_to.empty() : p->tied_to == t.owner) {
        mine = p;
      }
    }
    if (mine == nullptr || groups.tie(k) == nullptr) {
      return absl::InternalError(absl::StrCat(who, ": holds no end of the tied weight ", t.owner));
    }
    remote_.push_back({mine, groups.tie(k)});
  }
  return absl::OkStatus();
}

void TiedWeights::AddTo(std::set<const Parameter*>* tied) const {
  for (const TiedLink& l : local_) tied->insert({l.owner, l.copy});
  for (const Remote& r : remote_) tied->insert(r.param);
}

absl::Status TiedWeights::Reduce(Allocator* exec, const WaitFn& wait) const {
  PW_RETURN_IF_ERROR(AddTiedGradients(local_, exec));
  for (const Remote& r : remote_) {
    std::unique_ptr<Work> w = r.group->AllReduce(r.param->grad);
    PW_RETURN_IF_ERROR(wait(*w, absl::StrCat("the tied-weight all-reduce of ", r.param->name)));
  }
  return absl::OkStatus();
}

}  // namespace pipewright::internal

// Optimal contiguous partition of a layer graph into pipeline stages (docs/memory.md).
//
// For a fixed (pp, dp, schedule, micro-batching) the stage count S and each virtual stage's
// peak number of in-flight micro-batches are known before the split is (they follow from the
// program order alone), so a stage's time and memory depend only on its own layer range and
// its index. The objective is lexicographic: first the largest per-micro-batch stage time T*
// (which sets the steady-state throughput of every schedule: a step takes about
// (m - 1) * T* + sum of the stages), then the sum of stage times (fill and drain). Two exact
// dynamic programs over (stage, end layer) find it:
//   1. best[k][j] = min_i max(best[k-1][i], T_k(i, j))       the optimal bottleneck T*;
//   2. sum[k][j]  = min_i sum[k-1][i] + T_k(i, j), T_k <= T*  the least total among those.
// T_k(i, j) is the stage's compute time without recomputation when it fits in memory, with
// recomputation (one more forward) when only that fits, and infeasible otherwise. Scans over i
// stop as soon as a lower bound that only grows with the range (pure compute time, or the
// weights plus one micro-batch's activations) rules the rest out, so typical graphs cost far
// less than the O(S * L^2) worst case.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "partitioner/partition_internal.h"
#include "pipewright/partitioner.h"
#include "pipewright/simulator.h"
#include "pipewright/status.h"

namespace pipewright {

ParamBytes BytesPerParam(Precision precision) {
  if (precision == Precision::kFp32) return {4, 4, 8};
  // 16-bit weights, fp32 gradients, fp32 master weights + two fp32 moments.
  return {2, 4, 12};
}

std::vector<int> PeakInflightPerStage(const Schedule& schedule) {
  std::vector<int> held(schedule.num_stages, 0), peak(schedule.num_stages, 0);
  const ActionKind frees = schedule.split_backward ? ActionKind::kW : ActionKind::kB;
  for (const Program& prog : schedule.programs) {
    for (const Action& a : prog.actions) {
      const int s = a.virtual_stage;
      if (s < 0 || s >= schedule.num_stages) continue;
      if (a.kind == ActionKind::kF) {
        peak[s] = std::max(peak[s], ++held[s]);
      } else if (a.kind == frees) {
        --held[s];
      }
    }
  }
  return peak;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Parameter and byte counts are non-negative and saturate at kMemoryOverflow instead of
// overflowing int64: a saturated count stays saturated through every sum and product, so it is
// larger than any device and the run it describes is refused, never wrapped round to a small
// number (docs/memory.md, "Checked at start").
constexpr auto SatAdd = SaturatingAdd;
constexpr auto SatMul = SaturatingMul;
// a - b for b <= a, where a saturated stays saturated.
int64_t SatSub(int64_t a, int64_t b) { return a == kMemoryOverflow ? kMemoryOverflow : a - b; }
// The sum over [i, j) of a saturating prefix sum.
int64_t RangeSum(const std::vector<int64_t>& prefix, int i, int j) {
  return SatSub(prefix[j], prefix[i]);
}

}  // namespace

std::string internal::Bytes(int64_t b) {
  if (b == kMemoryOverflow) return "more than 8 EiB (the count overflows 64 bits)";
  const double x = static_cast<double>(b);
  if (std::abs(x) >= kGiB) return absl::StrFormat("%.2f GiB", x / kGiB);
  if (std::abs(x) >= (1 << 20)) return absl::StrFormat("%.2f MiB", x / (1 << 20));
  if (std::abs(x) >= 1024) return absl::StrFormat("%.1f KiB", x / 1024);
  return absl::StrCat(b, " B");
}

namespace {

using internal::Bytes;

// Whether the schedule runs weight gradients apart from input gradients (W actions).
bool SplitsBackward(const Schedule& s) {
  for (const Program& p : s.programs) {
    for (const Action& a : p.actions) {
      if (a.kind == ActionKind::kW) return true;
    }
  }
  return false;
}

// Costs of any layer range of one model at one micro-batch size, for one schedule.
class StageCosts {
 public:
  // `split_backward`: the schedule runs input and weight gradients apart (I, W), so a selective
  // stage holds its remade tensors from I to W: selective counts as none there (an upper bound).
  // `sharding`: what ZeRO splits over the data-parallel replicas (optimizer state, gradients).
  // `tp`: the seconds each layer's tensor-parallel collectives add to its forward and backward
  // (model is then one tensor-parallel device's view, ShardForTensorParallel).
  StageCosts(const ModelCosts& model, const DeviceSpec& dev, const ParamBytes& param_bytes,
             std::vector<int> inflight, int chunks, bool split_backward = false,
             const ZeroSharding& sharding = {}, const TensorParallelCosts* tp = nullptr)
      : model_(model),
        pb_(param_bytes),
        inflight_(std::move(inflight)),
        split_backward_(split_backward),
        sharding_(sharding) {
    const int L = model.num_layers();
    f_.assign(L + 1, 0);
    b_.assign(L + 1, 0);
    params_.assign(L + 1, 0);
    act_.assign(L + 1, 0);
    sel_bytes_.assign(L + 1, 0);
    sel_layer_.assign(L, 0);
    sel_time_.assign(L + 1, 0);
    const double flops_per_s = dev.tflops * 1e12;
    for (int i = 0; i < L; ++i) {
      const LayerCost& l = model.layers[i];
      const double f = l.forward_time_s ? *l.forward_time_s
                                        : l.forward_flops / flops_per_s + dev.layer_overhead_s;
      const double b = l.backward_time_s ? *l.backward_time_s
                                         : l.backward_flops / flops_per_s + dev.layer_overhead_s;
      const double f_comm = tp ? tp->forward_comm_s[i] : 0,
                   b_comm = tp ? tp->backward_comm_s[i] : 0;
      f_[i + 1] = f_[i] + f + f_comm;
      b_[i + 1] = b_[i] + b + b_comm;
      params_[i + 1] = SatAdd(params_[i], l.params);
      act_[i + 1] = SatAdd(act_[i], l.activation_bytes);
      sel_layer_[i] = std::min(l.selective_saving_bytes, l.activation_bytes);
      sel_bytes_[i + 1] = SatAdd(sel_bytes_[i], sel_layer_[i]);
      // The remaking runs at the forward's speed (measured forward times scale by FLOPs).
      const double sel = l.selective_recompute_flops <= 0 ? 0
                         : l.forward_flops > 0 ? f * l.selective_recompute_flops / l.forward_flops
                                               : l.selective_recompute_flops / flops_per_s;
      sel_time_[i + 1] = sel_time_[i] + sel;
      max_layer_ = std::max(max_layer_, f + f_comm + b + b_comm);
      // ZeRO-2's buckets are made of gradient groups: one can be as large as the largest.
      sharding_.largest_group_bytes = std::max(
          sharding_.largest_group_bytes,
          SatMul(l.largest_group_params > 0 ? l.largest_group_params : l.params, pb_.grads));
      if (!l.tied_to.empty()) {
        for (int o = 0; o < i; ++o) {
          if (model.layers[o].name == l.tied_to) ties_.push_back({i, o, l.params});
        }
      }
    }
    // Virtual stages of one rank share its memory; each gets an equal share (a sufficient
    // condition, exact for one chunk per rank; docs/memory.md).
    budget_ = (dev.memory_bytes - dev.reserve_bytes) / std::max(1, chunks);
  }

  int num_layers() const { return model_.num_layers(); }
  int64_t budget() const { return budget_; }
  double forward(int i, int j) const { return f_[j] - f_[i]; }
  double backward(int i, int j) const { return b_[j] - b_[i]; }
  double compute(int i, int j) const { return forward(i, j) + backward(i, j); }
  // Seconds of a selective stage's remaking per micro-batch; what it does not keep.
  double selective(int i, int j) const { return sel_time_[j] - sel_time_[i]; }
  int64_t selective_saving(int i, int j) const {
    return split_backward_ ? 0 : RangeSum(sel_bytes_, i, j);
  }
  // Extra seconds per micro-batch of recomputation `rc` on [i, j).
  double recompute_time(int i, int j, Recompute rc) const {
    if (rc == Recompute::kFull) return forward(i, j);
    if (rc == Recompute::kSelective) return selective(i, j);
    return 0;
  }
  double total_compute() const { return f_.back() + b_.back(); }
  double total_forward() const { return f_.back(); }
  double max_layer() const { return max_layer_; }
  int64_t params(int i, int j) const { return RangeSum(params_, i, j); }
  int64_t input_bytes(int i) const {
    return i == 0 ? model_.input_bytes : model_.layers[i - 1].output_bytes;
  }
  const ParamBytes& param_bytes() const { return pb_; }
  const ZeroSharding& sharding() const { return sharding_; }
  // Optimizer state of `params` parameters on one replica: an even share under ZeRO-1 and 2 (the
  // runtime splits by whole tensors, so a rank may hold up to one tensor's state more).
  int64_t OptimizerBytes(int64_t params) const {
    return sharding_.OptimizerBytes(SatMul(params, pb_.optimizer));
  }
  // Gradients of `params` parameters on one replica: all of them, or under ZeRO-2 a 1/dp shard
  // and the buckets in flight.
  int64_t GradientBytes(int64_t params) const {
    return sharding_.GradientBytes(SatMul(params, pb_.grads));
  }
  // A tied layer (LayerCost::tied_to): its index, its owner's and its parameter count.
  struct Tie {
    int copy = 0, owner = 0;
    int64_t params = 0;
  };
  const std::vector<Tie>& ties() const { return ties_; }
  const std::vector<int>& inflight() const { return inflight_; }

  // A tied layer whose owner is in the same stage holds a gradient only (its weight is the
  // owner's tensor; Note [Tied parameters] in runtime/model.cc).
  StageMemory Memory(int k, int i, int j, Recompute rc) const {
    StageMemory m;
    const int64_t p = params(i, j), trained = SatSub(p, linked_params(i, j));
    m.params = SatMul(trained, pb_.weights);
    m.grads = GradientBytes(p);
    m.optimizer = OptimizerBytes(trained);
    const int64_t saved = RangeSum(act_, i, j);
    const int64_t held = inflight_[k];
    if (rc == Recompute::kFull) {
      m.activations = SatAdd(SatMul(held, input_bytes(i)), saved);
    } else if (rc == Recompute::kSelective) {
      // The micro-batch in its backward holds at most one layer's remade tensors beside it;
      // counted as the whole stage's (an upper bound).
      const int64_t saving = selective_saving(i, j);
      m.activations =
          SatAdd(SatMul(held, SatSub(saved, saving)), saving > 0 ? MaxSelective(i, j) : 0);
    } else {
      m.activations = SatMul(held, saved);
    }
    m.total = SatAdd(SatAdd(m.params, m.grads), SatAdd(m.optimizer, m.activations));
    return m;
  }
  // Never above the memory of any recompute choice, and never shrinking as the range grows.
  int64_t MemoryLowerBound(int i, int j) const {
    const int64_t trained = SatSub(params(i, j), linked_params(i, j));
    const int64_t fixed = SatAdd(GradientBytes(params(i, j)),
                                 SatAdd(SatMul(trained, pb_.weights), OptimizerBytes(trained)));
    return SatAdd(fixed, SatSub(RangeSum(act_, i, j), selective_saving(i, j)));
  }
  // Parameters of tied layers in [i, j) whose owner is in [i, j) too.
  int64_t linked_params(int i, int j) const {
    int64_t n = 0;
    for (const Tie& t : ties_) {
      if (i <= t.copy && t.copy < j && i <= t.owner && t.owner < j) n = SatAdd(n, t.params);
    }
    return n;
  }

  // Per-micro-batch time of stage k on [i, j) and its recomputation — the fastest of none,
  // selective and full that fits; kInf when nothing fits.
  double Time(int k, int i, int j, bool allow_recompute, Recompute* rc) const {
    for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
      if (r != Recompute::kNone && !allow_recompute) break;
      if (r == Recompute::kSelective && selective_saving(i, j) == 0) continue;
      if (Memory(k, i, j, r).total <= budget_) {
        *rc = r;
        return compute(i, j) + recompute_time(i, j, r);
      }
    }
    return kInf;
  }
  // The smallest memory of stage k on [i, j) over the allowed recompute choices.
  StageMemory LeastMemory(int k, int i, int j, bool allow_recompute, Recompute* rc) const {
    StageMemory best = Memory(k, i, j, Recompute::kNone);
    *rc = Recompute::kNone;
    if (!allow_recompute) return best;
    for (Recompute r : {Recompute::kSelective, Recompute::kFull}) {
      StageMemory m = Memory(k, i, j, r);
      if (m.total < best.total) {
        best = m;
        *rc = r;
      }
    }
    return best;
  }

 private:
  const ModelCosts& model_;
  ParamBytes pb_;
  std::vector<int> inflight_;
  std::vector<double> f_, b_;
  // The largest selective saving of one layer in [i, j).
  int64_t MaxSelective(int i, int j) const {
    int64_t most = 0;
    for (int l = i; l < j; ++l) most = std::max(most, sel_layer_[l]);
    return most;
  }
  bool split_backward_ = false;
  ZeroSharding sharding_;
  // Saturating prefix sums (SatAdd) over the layers; sel_layer_ per layer.
  std::vector<int64_t> params_, act_, sel_bytes_, sel_layer_;
  std::vector<double> sel_time_;
  std::vector<Tie> ties_;
  double max_layer_ = 0;
  int64_t budget_ = 0;
};

struct Split {
  std::vector<int> bounds;  // S + 1
  std::vector<Recompute> recompute;
};

// Step 1 of the file comment: the optimal bottleneck, or kInf when no split fits.
double OptimalBottleneck(const StageCosts& c, int S, bool allow_recompute) {
  const int L = c.num_layers();
  std::vector<double> prev(L + 1, kInf), cur(L + 1, kInf);
  prev[0] = 0;
  for (int k = 0; k < S; ++k) {
    std::fill(cur.begin(), cur.end(), kInf);
    // Stage k ends at j: at least k + 1 layers before it, S - k - 1 after it.
    for (int j = k + 1; j <= L - (S - k - 1); ++j) {
      double best = kInf;
      for (int i = j - 1; i >= k; --i) {
        if (c.compute(i, j) >= best) break;  // only grows as i falls
        if (c.MemoryLowerBound(i, j) > c.budget()) break;
        if (prev[i] >= best) continue;
        Recompute rc = Recompute::kNone;
        const double t = c.Time(k, i, j, allow_recompute, &rc);
        best = std::min(best, std::max(prev[i], t));
      }
      cur[j] = best;
    }
    std::swap(prev, cur);
  }
  return prev[L];
}

// Step 2: among splits whose every stage is within `cap`, the one with the least total time.
bool LeastTotalWithin(const StageCosts& c, int S, bool allow_recompute, double cap, Split* out) {
  const int L = c.num_layers();
  std::vector<std::vector<double>> sum(S + 1, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int>> from(S + 1, std::vector<int>(L + 1, -1));
  std::vector<std::vector<Recompute>> how(S + 1, std::vector<Recompute>(L + 1, Recompute::kNone));
  sum[0][0] = 0;
  for (int k = 0; k < S; ++k) {
    for (int j = k + 1; j <= L - (S - k - 1); ++j) {
      for (int i = j - 1; i >= k; --i) {
        if (c.compute(i, j) > cap) break;
        if (c.MemoryLowerBound(i, j) > c.budget()) break;
        if (sum[k][i] == kInf) continue;
        Recompute rc = Recompute::kNone;
        const double t = c.Time(k, i, j, allow_recompute, &rc);
        if (t > cap) continue;
        if (sum[k][i] + t < sum[k + 1][j]) {
          sum[k + 1][j] = sum[k][i] + t;
          from[k + 1][j] = i;
          how[k + 1][j] = rc;
        }
      }
    }
  }
  if (sum[S][L] == kInf) return false;
  out->bounds.assign(S + 1, 0);
  out->recompute.assign(S, Recompute::kNone);
  out->bounds[S] = L;
  for (int k = S, j = L; k > 0; --k) {
    out->recompute[k - 1] = how[k][j];
    j = from[k][j];
    out->bounds[k - 1] = j;
  }
  return true;
}

// When nothing fits: the split whose worst stage overflows least, for the error message.
Split LeastOverflow(const StageCosts& c, int S, bool allow_recompute) {
  const int L = c.num_layers();
  std::vector<std::vector<double>> worst(S + 1, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int>> from(S + 1, std::vector<int>(L + 1, -1));
  worst[0][0] = -kInf;
  for (int k = 0; k < S; ++k) {
    for (int j = k + 1; j <= L - (S - k - 1); ++j) {
      for (int i = j - 1; i >= k; --i) {
        // No i further down can do better than the best so far: its stage's memory is at least
        // the lower bound, which only grows as the stage does. (Both skips keep the result: only
        // a strictly smaller worst replaces the best.)
        if (static_cast<double>(c.MemoryLowerBound(i, j) - c.budget()) >= worst[k + 1][j]) break;
        if (worst[k][i] >= worst[k + 1][j]) continue;
        Recompute rc = Recompute::kNone;
        const double over =
            static_cast<double>(c.LeastMemory(k, i, j, allow_recompute, &rc).total - c.budget());
        const double w = std::max(worst[k][i], over);
        if (w < worst[k + 1][j]) {
          worst[k + 1][j] = w;
          from[k + 1][j] = i;
        }
      }
    }
  }
  Split s;
  s.bounds.assign(S + 1, 0);
  s.recompute.assign(S, Recompute::kNone);
  s.bounds[S] = L;
  for (int k = S, j = L; k > 0; --k) {
    j = from[k][j];
    s.bounds[k - 1] = j;
  }
  for (int k = 0; k < S; ++k) {
    c.LeastMemory(k, s.bounds[k], s.bounds[k + 1], allow_recompute, &s.recompute[k]);
  }
  return s;
}

// A virtual stage's layers [begin, end) and recomputation.
struct StageSplit {
  int begin = 0, end = 0;
  Recompute recompute = Recompute::kNone;
};

// Each virtual stage's memory (StageCosts::Memory), where a tied layer whose owner is in another
// stage of the same rank (a V schedule's first and last) is linked to it too: its stage holds its
// gradient only. One entry of `stages` per stage of `sched`, each a valid range (the caller
// checks).
std::vector<StageMemory> SplitMemory(const StageCosts& c, const Schedule& sched,
                                     const std::vector<StageSplit>& stages) {
  const int S = sched.num_stages;
  std::vector<StageMemory> memory(S);
  for (int k = 0; k < S; ++k) {
    memory[k] = c.Memory(k, stages[k].begin, stages[k].end, stages[k].recompute);
  }
  auto stage_of = [&](int layer) {
    int found = -1;
    for (int k = 0; k < S; ++k) {
      if (stages[k].begin <= layer && layer < stages[k].end) found = k;
    }
    return found;
  };
  for (const StageCosts::Tie& t : c.ties()) {
    const int copy_stage = stage_of(t.copy), owner_stage = stage_of(t.owner);
    if (copy_stage < 0 || owner_stage < 0 || copy_stage == owner_stage ||
        sched.stage_rank[copy_stage] != sched.stage_rank[owner_stage]) {
      continue;
    }
    StageMemory& m = memory[copy_stage];
    if (m.total == kMemoryOverflow) continue;  // nothing to subtract from
    const int b = stages[copy_stage].begin, e = stages[copy_stage].end;
    const int64_t trained = c.params(b, e) - c.linked_params(b, e);
    const int64_t before = m.params + m.optimizer;
    m.params -= t.params * c.param_bytes().weights;
    m.optimizer = c.OptimizerBytes(trained - t.params);
    m.total -= before - (m.params + m.optimizer);
  }
  return memory;
}

// Fills stage and plan predictions for plan's split and recompute choices; `generated` is
// GenerateSchedule(plan.schedule).
absl::Status PredictWith(const StageCosts& c, const ModelCosts& model, const DeviceSpec& dev,
                         const Schedule& generated, Plan& plan) {
  Schedule sched = generated;
  PW_RETURN_IF_ERROR(LowerComm(sched));
  const int S = sched.num_stages;
  const int p = plan.pipeline_parallel;
  if (static_cast<int>(plan.stages.size()) != S) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan has ", plan.stages.size(), " stages; the schedule has ", S));
  }
  SimCosts costs;
  std::vector<int64_t> rank_memory(p, 0), rank_params(p, 0);
  double worst = -1, largest_message = 0;
  int64_t max_stage_params = 0;
  std::vector<StageSplit> split;
  for (int k = 0; k < S; ++k) {
    const PlanStage& st = plan.stages[k];
    if (st.begin < 0 || st.end > model.num_layers() || st.begin >= st.end) {
      return absl::InvalidArgumentError(absl::StrCat("stages[", k, "].layers: range [", st.begin,
                                                     ", ", st.end, ") is not valid"));
    }
    split.push_back({st.begin, st.end, st.recompute});
  }
  const std::vector<StageMemory> memory = SplitMemory(c, sched, split);
  for (int k = 0; k < S; ++k) {
    PlanStage& st = plan.stages[k];
    const int i = st.begin, j = st.end;
    const double f = c.forward(i, j), b = c.backward(i, j);
    const double rc = c.recompute_time(i, j, st.recompute);
    st.forward_s = f;
    st.backward_s = b + rc;
    st.memory = memory[k];
    st.rank = sched.stage_rank[k];
    // I and W each take half of the backward where the schedule splits them; the
    // recomputed forward runs before I.
    costs.stage_f.push_back(f);
    costs.stage_b.push_back(b / 2 + rc);
    costs.stage_w.push_back(b / 2);
    rank_memory[st.rank] = SatAdd(rank_memory[st.rank], st.memory.total);
    rank_params[st.rank] = SatAdd(rank_params[st.rank], c.params(i, j));
    max_stage_params = std::max(max_stage_params, c.params(i, j));
    if (j < model.num_layers()) {
      largest_message =
          std::max(largest_message, static_cast<double>(model.layers[j - 1].output_bytes));
    }
    if (f + b + rc > worst) {
      worst = f + b + rc;
      plan.predicted.bottleneck_stage = k;
    }
  }
  costs.comm_latency = dev.link_latency_s;
  costs.comm_per_byte = 1.0 / dev.link_bandwidth;
  costs.message_bytes = largest_message;
  // The data-parallel gradient synchronization of the stage with the most parameters (all-reduce,
  // or ZeRO's reduce-scatters and all-gather), after the backward like the all-reduce.
  costs.reduce_time = PredictGradSync(max_stage_params, c.param_bytes(), c.sharding(),
                                      plan.schedule.micro_batches, dev)
                          .seconds;
  // The optimizer reads every parameter's state once and writes weights and moments back.
  const int64_t most_params = *std::max_element(rank_params.begin(), rank_params.end());
  costs.optimizer_time =
      static_cast<double>(most_params) / c.sharding().optimizer_shards() *
      (c.param_bytes().total() + c.param_bytes().weights + c.param_bytes().optimizer) /
      dev.memory_bandwidth;
  PW_ASSIGN_OR_RETURN(SimResult sim, Simulate(sched, costs, SimOptions{.timeline = false}));
  PlanPrediction& pr = plan.predicted;
  pr.step_time_s = sim.makespan;
  pr.bubble_fraction = sim.bubble_fraction;
  pr.samples_per_s = sim.makespan > 0 ? plan.global_batch() / sim.makespan : 0;
  pr.peak_memory_bytes = *std::max_element(rank_memory.begin(), rank_memory.end());

  // The lower bound: every stage at max(sum / S, largest layer), nothing else slowing it.
  const double per_stage = std::max(c.total_compute() / S, c.max_layer());
  const double fwd_share = c.total_compute() > 0 ? c.total_forward() / c.total_compute() : 0.5;
  SimCosts ideal;
  ideal.stage_f.assign(S, per_stage * fwd_share);
  ideal.stage_b.assign(S, per_stage * (1 - fwd_share) / 2);
  ideal.stage_w.assign(S, per_stage * (1 - fwd_share) / 2);
  ideal.reduce_time = costs.reduce_time;
  ideal.optimizer_time = costs.optimizer_time;
  PW_ASSIGN_OR_RETURN(SimResult best, Simulate(sched, ideal, SimOptions{.timeline = false}));
  pr.lower_bound_step_time_s = std::min(best.makespan, sim.makespan);
  pr.lower_bound_gap =
      pr.lower_bound_step_time_s > 0 ? sim.makespan / pr.lower_bound_step_time_s - 1 : 0;
  return absl::OkStatus();
}

Plan EmptyPlan(const ModelCosts& model, const DeviceSpec& dev, const ScheduleSpec& spec, int dp,
               int64_t b) {
  Plan plan;
  plan.model_name = model.name;
  plan.num_layers = model.num_layers();
  plan.fingerprint = model.fingerprint;
  plan.devices = dev.count;
  plan.device_memory_bytes = dev.memory_bytes;
  plan.pipeline_parallel = spec.ranks;
  plan.data_parallel = dp;
  plan.schedule = spec;
  plan.micro_batch_size = b;
  return plan;
}

std::string DescribeStageMemory(const StageMemory& m) {
  return absl::StrCat("weights ", Bytes(m.params), ", gradients ", Bytes(m.grads), ", optimizer ",
                      Bytes(m.optimizer), ", activations ", Bytes(m.activations));
}

}  // namespace

absl::StatusOr<Plan> Partition(const ModelCosts& model, const DeviceSpec& dev,
                               const PartitionOptions& o) {
  int64_t shortfall = 0;
  return internal::Partition(model, dev, o, &shortfall);
}

absl::StatusOr<Plan> internal::Partition(const ModelCosts& model, const DeviceSpec& dev,
                                         const PartitionOptions& o, int64_t* shortfall,
                                         const Schedule* given) {
  *shortfall = 0;
  PW_RETURN_IF_ERROR(ValidatePartitionOptions(model, dev, o));
  const int64_t b = o.micro_batch_size ? o.micro_batch_size : model.micro_batch_size;
  // One tensor-parallel device's share of the model at this micro-batch size.
  PW_ASSIGN_OR_RETURN(
      const TensorParallelCosts tpc,
      ShardForTensorParallel(model.WithMicroBatchSize(b), dev, o.tp, o.sequence_parallel));
  const ModelCosts& scaled = tpc.rank;
  ScheduleSpec spec{o.schedule, o.pp, o.micro_batches, o.chunks};
  std::optional<Schedule> generated;
  if (given == nullptr) {
    PW_ASSIGN_OR_RETURN(generated, GenerateSchedule(spec));
  } else if (given->spec.kind != spec.kind || given->spec.ranks != spec.ranks ||
             given->spec.micro_batches != spec.micro_batches) {
    return absl::InternalError("Partition: the given schedule is not the options'");
  }
  const Schedule& sched = given != nullptr ? *given : *generated;
  spec = sched.spec;  // zb-v's chunks = 2
  const int S = sched.num_stages;
  const int L = scaled.num_layers();
  if (S > L) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split ", L, " layers into ", S,
                                                   " non-empty stages (pp ", o.pp, " x chunks ",
                                                   spec.chunks, ")"));
  }
  if (S > kMaxPlanStages) {  // a plan reader refuses more (plan.h): never write one
    return absl::InvalidArgumentError(absl::StrCat("pp ", o.pp, " x chunks ", spec.chunks, " = ", S,
                                                   " stages; a plan has at most ", kMaxPlanStages));
  }
  StageCosts c(scaled, dev, BytesPerParam(o.precision), PeakInflightPerStage(sched), spec.chunks,
               SplitsBackward(sched), ZeroSharding{o.zero, o.dp}, &tpc);
  const double bottleneck = OptimalBottleneck(c, S, o.allow_recompute);
  Plan plan = EmptyPlan(scaled, dev, spec, o.dp, b);
  plan.zero = o.zero;
  plan.tensor_parallel = o.tp;
  plan.sequence_parallel = o.sequence_parallel;
  Split split;
  if (bottleneck == kInf) {
    split = LeastOverflow(c, S, o.allow_recompute);
    int worst = 0;
    StageMemory worst_mem;
    for (int k = 0; k < S; ++k) {
      StageMemory m = c.Memory(k, split.bounds[k], split.bounds[k + 1], split.recompute[k]);
      if (k == 0 || m.total > worst_mem.total) {
        worst = k;
        worst_mem = m;
      }
    }
    *shortfall = worst_mem.total - c.budget();
    const std::string message = absl::StrFormat(
        "%s does not fit: with the best split (stages at layers [%s]) stage %d (layers [%d, %d), "
        "%s, %d micro-batch(es) in flight%s) needs %s (%s) but a %s holds %s%s: %s short",
        model.name, absl::StrJoin(split.bounds, ", "), worst, split.bounds[worst],
        split.bounds[worst + 1], ScheduleKindName(spec.kind), c.inflight()[worst],
        split.recompute[worst] == Recompute::kFull        ? ", recomputing"
        : split.recompute[worst] == Recompute::kSelective ? ", recomputing selectively"
                                                          : "",
        Bytes(worst_mem.total), DescribeStageMemory(worst_mem),
        spec.chunks > 1 ? absl::StrCat("1/", spec.chunks, " share of a device") : "device",
        Bytes(c.budget()),
        dev.reserve_bytes ? absl::StrCat(" after a ", Bytes(dev.reserve_bytes), " reserve") : "",
        Bytes(*shortfall));
    if (!o.suggest) return absl::FailedPreconditionError(message);
    const int64_t all = c.params(0, L);
    const int64_t static_bytes = SatAdd(SatMul(all, c.param_bytes().weights),
                                        SatAdd(c.GradientBytes(all), c.OptimizerBytes(all)));
    std::vector<std::string> ideas =
        internal::Suggestions(model, dev, o, b, S, c.budget(), static_bytes);
    return absl::FailedPreconditionError(
        absl::StrCat(message, ".\nwould fit: ", absl::StrJoin(ideas, "; or ")));
  }
  if (!LeastTotalWithin(c, S, o.allow_recompute, bottleneck * (1 + 1e-12), &split)) {
    return absl::InternalError("partition: no split within the optimal bottleneck");
  }
  for (int k = 0; k < S; ++k) {
    PlanStage st;
    st.index = k;
    st.begin = split.bounds[k];
    st.end = split.bounds[k + 1];
    st.recompute = split.recompute[k];
    plan.stages.push_back(st);
  }
  PW_RETURN_IF_ERROR(PredictWith(c, scaled, dev, sched, plan));
  return plan;
}

absl::Status Predict(const ModelCosts& model, const DeviceSpec& dev, Precision precision,
                     Plan& plan) {
  PW_ASSIGN_OR_RETURN(const TensorParallelCosts tpc,
                      ShardForTensorParallel(model.WithMicroBatchSize(plan.micro_batch_size), dev,
                                             plan.tensor_parallel, plan.sequence_parallel));
  PW_ASSIGN_OR_RETURN(Schedule sched, GenerateSchedule(plan.schedule));
  StageCosts c(tpc.rank, dev, BytesPerParam(precision), PeakInflightPerStage(sched),
               sched.spec.chunks, SplitsBackward(sched),
               ZeroSharding{plan.zero, plan.data_parallel}, &tpc);
  return PredictWith(c, tpc.rank, dev, sched, plan);
}

absl::StatusOr<std::vector<RankMemory>> PredictRankMemory(const ModelCosts& model,
                                                          const Schedule& schedule,
                                                          const std::vector<int>& boundaries,
                                                          const std::vector<Recompute>& recompute,
                                                          const ParamBytes& param_bytes,
                                                          const ZeroSharding& sharding) {
  const int S = schedule.num_stages, L = model.num_layers();
  const int ranks = static_cast<int>(schedule.programs.size());
  if (S < 1 || static_cast<int>(schedule.stage_rank.size()) != S) {
    return absl::InvalidArgumentError("PredictRankMemory: the schedule places no stages");
  }
  if (static_cast<int>(boundaries.size()) != S + 1 || static_cast<int>(recompute.size()) != S) {
    return absl::InvalidArgumentError(
        absl::StrCat("PredictRankMemory: ", boundaries.size(), " boundaries and ", recompute.size(),
                     " recompute entries for ", S, " stages (want ", S + 1, " and ", S, ")"));
  }
  if (boundaries.front() != 0 || boundaries.back() != L) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PredictRankMemory: the boundaries must run from 0 to the model's ", L, " layers"));
  }
  std::vector<StageSplit> split;
  for (int k = 0; k < S; ++k) {
    if (boundaries[k] >= boundaries[k + 1]) {
      return absl::InvalidArgumentError(absl::StrCat("PredictRankMemory: stage ", k, "'s range [",
                                                     boundaries[k], ", ", boundaries[k + 1],
                                                     ") is empty"));
    }
    if (schedule.stage_rank[k] < 0 || schedule.stage_rank[k] >= ranks) {
      return absl::InvalidArgumentError(absl::StrCat("PredictRankMemory: stage ", k,
                                                     " is placed on rank ", schedule.stage_rank[k],
                                                     " of ", ranks));
    }
    split.push_back({boundaries[k], boundaries[k + 1], recompute[k]});
  }
  if (sharding.zero < 0 || sharding.zero > 2 || sharding.dp < 1 || sharding.bucket_bytes < 1 ||
      sharding.buffers < 1 || sharding.buffers > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PredictRankMemory: ZeRO ", sharding.zero, " over ", sharding.dp, " replicas with ",
        sharding.bucket_bytes, "-byte buckets and ", sharding.buffers,
        " buffers: want zero 0, 1 or 2, dp >= 1, buckets >= 1 byte and 1 or 2 buffers"));
  }
  const std::vector<int> held = PeakInflightPerStage(schedule);
  StageCosts c(model, DeviceSpec{}, param_bytes, held, schedule.spec.chunks,
               SplitsBackward(schedule), sharding);
  const std::vector<StageMemory> memory = SplitMemory(c, schedule, split);
  std::vector<RankMemory> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r].rank = r;
  for (int k = 0; k < S; ++k) {
    RankMemory& r = out[schedule.stage_rank[k]];
    r.stages.push_back(k);
    r.held.push_back(held[k]);
    StageMemory& m = r.memory;
    m.params = SatAdd(m.params, memory[k].params);
    m.grads = SatAdd(m.grads, memory[k].grads);
    m.optimizer = SatAdd(m.optimizer, memory[k].optimizer);
    m.activations = SatAdd(m.activations, memory[k].activations);
    m.total = SatAdd(m.total, memory[k].total);
  }
  return out;
}

absl::StatusOr<std::vector<int>> BalancedBoundaries(const ModelCosts& model, int stages) {
  const int L = model.num_layers();
  if (stages < 1 || stages > L) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", model.name, "'s ", L, " layers into ", stages,
                     " non-empty stages (pp x chunks must be between 1 and the number of layers)"));
  }
  // The partitioner's own programs with FLOPs as the time unit (one "FLOP per second", no
  // per-layer overhead), unbounded memory and one micro-batch in flight: the bottleneck is then
  // the largest stage's FLOPs. Every layer weighs at least 1, so empty-cost layers still spread.
  ModelCosts flops = model;
  for (LayerCost& l : flops.layers) {
    l.forward_time_s.reset();
    l.backward_time_s.reset();
    l.backward_flops = std::max(l.backward_flops, 1.0 - l.forward_flops);
  }
  DeviceSpec dev;
  dev.tflops = 1e-12;
  dev.layer_overhead_s = 0;
  dev.memory_bytes = std::numeric_limits<int64_t>::max() / 4;
  StageCosts c(flops, dev, BytesPerParam(Precision::kFp32), std::vector<int>(stages, 1), 1);
  const double bottleneck = OptimalBottleneck(c, stages, /*allow_recompute=*/false);
  Split split;
  if (bottleneck == kInf || !LeastTotalWithin(c, stages, false, bottleneck * (1 + 1e-12), &split)) {
    return absl::InternalError("balanced split: no split within the optimal bottleneck");
  }
  return split.bounds;
}

}  // namespace pipewright

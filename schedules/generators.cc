// Schedule generators: the compute actions of every rank for each ScheduleKind.
//
// Note [GPipe]. Every rank runs all m forwards (micro 0..m-1), then all m backwards in the
// same order 0..m-1 (the order the 1F1B cool-down drains them). Peak in-flight: m.
//
// Note [1F1B warm-up]. PipeDream-Flush: rank r runs w = min(p - r - 1, m) warm-up forwards,
// then steady pairs (F of micro j + w, B of micro j) until the forwards run out, then the
// cool-down backwards. A micro-batch is in flight from its F to its B, so the peak on rank r
// is w + 1 = min(m, p - r). With equal costs the makespan is (m + p - 1)(F + B).
//
// Note [Interleaved]. Megatron-LM interleaved 1F1B: rank r owns v chunks, virtual stages
// r, r + p, ..., r + (v-1)p. Micro-batches go in groups of p; within a group the rank walks
// chunk-major, so its k-th forward is micro (k / (p v)) p + k % p on chunk (k / p) % v, and its
// k-th backward is the same micro on chunk v - 1 - (k / p) % v. Warm-up is
// min(2 (p - r - 1) + (v - 1) p, m v) forwards, then 1F1B pairs, then the cool-down. Every
// rank's channel sees messages in the same (group, chunk, micro) order on both ends, which
// is what keeps the FIFO channels in step. m must be a multiple of p: with a partial last
// group (walked chunk-major over its g < p micro-batches) the warm-up depth no longer
// matches and the programs deadlock (e.g. p=5 m=7 v=2), so other m are refused with the
// nearest multiples. v = 1 is exactly
// 1F1B (Megatron's interleaved warm-up formula would give 2(p - r - 1) there, deeper than
// needed). Equal costs: bubble (p - 1) / (v m + p - 1), rank-0 peak p + (p - 1) / v stages.
//
// Note [ZB-H1]. Zero Bubble (Qi et al. 2023), handcrafted ZB-H1. The backward is split into
// I (input gradient, on the critical path) and W (weight gradient, deferrable). Rank r runs
// the 1F1B order with each B replaced by I; after I of micro j it runs W of micro j - r
// (when j >= r), and the r weight gradients still owed run at the very end. The lag of r
// W's on rank r is what fills the cool-down: the I chain of the last micro-batch runs back
// through the ranks while each rank still has W's to do. With F = I = W = 1 the makespan is
// 3m + p - 1 for m >= p (checked by the tests' own simulation). Memory counts a micro-batch
// until its W: rank r peaks at min(m, p) = the 1F1B peak of rank 0, as in the paper (the
// maximum over ranks equals 1F1B's; later ranks hold more than their own 1F1B peak p - r).
//
// Note [ZB-V]. Zero Bubble's ZB-V: v = 2 chunks in a "V" (stage s on rank s for s < p, on rank
// 2p - 1 - s otherwise), so rank 0 holds the first and the last stage. The order comes from
// a greedy list schedule on unit-time actions (F = I = W = 1 per chunk) with a memory cap
// of 2p chunk activations per rank (= p whole stages, 1F1B's rank-0 peak), counted from F
// to W. At each time step every idle rank picks a ready I (its output gradient has
// arrived) or a ready F (its input has arrived and it fits under the cap), else the oldest
// pending W. Eight priority rules (I before F or F before I; deeper or shallower chunk first
// for each) are tried and the shortest timeline is kept; a rule that stalls (every rank at
// the cap with nothing ready) is skipped. Every stage runs its F, I and W in micro-batch
// order, so each channel (one stage per direction per rank pair in the V) stays FIFO.
// Replaying the per-rank order ASAP is never slower than the greedy timeline. For equal
// costs and m >= 2p the makespan is 3m + (p - 1)/2 whole-stage units, the lower bound (the
// middle rank cannot start before p - 1 chunk forwards): zero bubble apart from that ramp
// (the tests check p <= 10). Smaller m is generated too, with small extra bubbles.
// spec.chunks may be 1 (the spec default, meaning 2) or 2; the result has chunks = 2.
//
// Note [DualPipeV]. DeepSeek-V3's DualPipe folded into a V (the "cut-in-half" DualPipe of
// DeepSeek's DualPipeV and torch.distributed.pipelining's ScheduleDualPipeV): the zb-v
// placement (chunk 0 = stage r on rank r, chunk 1 = stage 2p - 1 - r), each chunk taking its
// micro-batches in order 0..m-1, and m >= 2p. Rank r runs eight phases:
//   1. 2(p - r - 1) forwards of chunk 0;
//   2. r + 1 pairs (F chunk 0, F chunk 1);
//   3. p - r - 1 times: the input gradient of chunk 1 with its weight gradient deferred, one
//      deferred weight gradient, F chunk 1;
//   4. m - 2p + r + 1 times the steady pair "F chunk 0 + backward chunk 1" then "F chunk 1 +
//      backward chunk 0" (on a GPU each pair overlaps one micro-batch's forward with another's
//      backward and their communication: DualPipe's point);
//   5. p - r - 1 times: backward chunk 1, then F chunk 1 + backward chunk 0;
//   6. r + 1 pairs (backward chunk 1, backward chunk 0), the second half of them with deferred
//      weight gradients (odd ranks switch one backward earlier than even ranks);
//   7. p - r - 1 times: one deferred weight gradient, then backward chunk 0 with its weight
//      gradient deferred;
//   8. the r + 1 weight gradients still deferred.
// A backward is the input-gradient half I followed at once by its W, or, where deferred, I now
// and W later from one first-in first-out queue per rank (zero-bubble's split). Counting both
// chunks, every rank's F, I and W per chunk run in micro-batch order, so the channels stay FIFO.
// Equal costs: bubble and peak activations are in docs/schedules.md (the tests' simulation).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "pipewright/schedule.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

Action Make(ActionKind k, int stage, int mb) { return Action{k, stage, mb}; }

// 1F1B interleaving of two per-rank sequences: `warmup` forwards, then (F, B) pairs, then
// the remaining backwards.
std::vector<Action> OneFOneB(const std::vector<Action>& fwd, const std::vector<Action>& bwd,
                             int warmup) {
  std::vector<Action> out;
  const int n = static_cast<int>(fwd.size());
  warmup = std::min(warmup, n);
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(fwd[f]);
  while (f < n) {
    out.push_back(fwd[f++]);
    out.push_back(bwd[b++]);
  }
  while (b < static_cast<int>(bwd.size())) out.push_back(bwd[b++]);
  return out;
}

void GenGpipe(Schedule& s) {
  const int m = s.spec.micro_batches;
  for (Program& prog : s.programs) {
    for (int j = 0; j < m; ++j) prog.actions.push_back(Make(ActionKind::kF, prog.rank, j));
    for (int j = 0; j < m; ++j) prog.actions.push_back(Make(ActionKind::kB, prog.rank, j));
  }
}

// PipeDream-Flush order of one non-interleaved rank: min(p - r - 1, m) warm-up forwards, then
// (F, backward) pairs, then the remaining backwards; `backward` is B, or I for zb-h1.
std::vector<Action> FlushOrder(int p, int m, int r, ActionKind backward) {
  std::vector<Action> fwd, bwd;
  for (int j = 0; j < m; ++j) {
    fwd.push_back(Make(ActionKind::kF, r, j));
    bwd.push_back(Make(backward, r, j));
  }
  return OneFOneB(fwd, bwd, std::min(p - r - 1, m));
}

void Gen1F1B(Schedule& s) {
  for (Program& prog : s.programs) {
    prog.actions = FlushOrder(s.spec.ranks, s.spec.micro_batches, prog.rank, ActionKind::kB);
  }
}

void GenInterleaved(Schedule& s) {
  const int p = s.spec.ranks, m = s.spec.micro_batches, v = s.spec.chunks;
  for (Program& prog : s.programs) {
    const int r = prog.rank;
    std::vector<Action> fwd, bwd;
    for (int k = 0; k < m * v; ++k) {
      const int mb = (k / (p * v)) * p + k % p;
      const int chunk = (k / p) % v;
      fwd.push_back(Make(ActionKind::kF, chunk * p + r, mb));
      bwd.push_back(Make(ActionKind::kB, (v - 1 - chunk) * p + r, mb));
    }
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, m * v);
    prog.actions = OneFOneB(fwd, bwd, warmup);
  }
}

void GenZbH1(Schedule& s) {
  const int p = s.spec.ranks, m = s.spec.micro_batches;
  for (Program& prog : s.programs) {
    const int r = prog.rank;
    std::vector<Action> base = FlushOrder(p, m, r, ActionKind::kI);
    int next_w = 0;
    for (const Action& a : base) {
      prog.actions.push_back(a);
      if (a.kind == ActionKind::kI && a.micro_batch >= r) {
        prog.actions.push_back(Make(ActionKind::kW, r, next_w++));
      }
    }
    while (next_w < m) prog.actions.push_back(Make(ActionKind::kW, r, next_w++));
  }
}

// Note [DualPipeV]: replays rank r's phases with per-chunk micro-batch counters and a FIFO of
// deferred weight gradients.
class DualPipeVRank {
 public:
  DualPipeVRank(int p, int r, std::vector<Action>& out) : p_(p), r_(r), out_(out) {}

  void Forward(int chunk) { out_.push_back(Make(ActionKind::kF, Stage(chunk), next_f_[chunk]++)); }
  void Backward(int chunk, bool defer_weight) {
    const Action i = Make(ActionKind::kI, Stage(chunk), next_b_[chunk]++);
    out_.push_back(i);
    const Action w = Make(ActionKind::kW, i.virtual_stage, i.micro_batch);
    if (defer_weight) {
      deferred_.push_back(w);
    } else {
      out_.push_back(w);
    }
  }
  void Weight() {
    out_.push_back(deferred_.front());
    deferred_.erase(deferred_.begin());
  }
  // The overlapped pair of DualPipe: F of one chunk with the backward of the other.
  void ForwardBackward(int f_chunk, int b_chunk) {
    Forward(f_chunk);
    Backward(b_chunk, false);
  }
  bool done() const { return deferred_.empty(); }

 private:
  int Stage(int chunk) const { return chunk == 0 ? r_ : 2 * p_ - 1 - r_; }
  int p_, r_;
  std::vector<Action>& out_;
  int next_f_[2] = {0, 0}, next_b_[2] = {0, 0};
  std::vector<Action> deferred_;
};

void GenDualPipeV(Schedule& s) {
  const int p = s.spec.ranks, m = s.spec.micro_batches;
  for (Program& prog : s.programs) {
    const int r = prog.rank;
    DualPipeVRank k(p, r, prog.actions);
    for (int i = 0; i < 2 * (p - r - 1); ++i) k.Forward(0);  // 1
    for (int i = 0; i < r + 1; ++i) {                        // 2
      k.Forward(0);
      k.Forward(1);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 3
      k.Backward(1, true);
      k.Weight();
      k.Forward(1);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {  // 4
      k.ForwardBackward(0, 1);
      k.ForwardBackward(1, 0);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 5
      k.Backward(1, false);
      k.ForwardBackward(1, 0);
    }
    bool defer = false;
    for (int i = 0; i < r + 1; ++i) {  // 6
      if (i == (r + 1) / 2 && r % 2 == 1) defer = true;
      k.Backward(1, defer);
      if (i == (r + 1) / 2 && r % 2 == 0) defer = true;
      k.Backward(0, defer);
    }
    for (int i = 0; i < p - r - 1; ++i) {  // 7
      k.Weight();
      k.Backward(0, true);
    }
    while (!k.done()) k.Weight();  // 8
  }
}

// Priority rules for the ZB-V greedy list schedule (Note [ZB-V]).
struct ZbVPolicy {
  bool f_before_i = false;   // an F that fits under the cap beats a ready I
  bool i_deep_first = true;  // among ready I, the chunk-1 stage first
  bool f_deep_first = true;  // among ready F, the chunk-1 stage first
};

// Greedy unit-time list schedule; returns per-rank orders and the greedy makespan, or an
// error when the rules stall (all ranks at the memory cap with nothing else ready).
absl::StatusOr<long> GreedyZbV(int p, int m, const ZbVPolicy& policy,
                               std::vector<std::vector<Action>>& orders) {
  orders.assign(p, {});
  const int S = 2 * p;
  const int cap = 2 * p;  // chunk activations per rank
  const long kNever = -1;
  // Finish times (unit steps) of F and I per (mb, stage); kNever until scheduled.
  std::vector<long> fin_f(m * S, kNever), fin_i(m * S, kNever), fin_w(m * S, kNever);
  std::vector<int> nf(S, 0), ni(S, 0), nw(S, 0);
  std::vector<int> inflight(p, 0);
  auto idx = [&](int mb, int st) { return mb * S + st; };
  auto done_by = [&](long fin, long t) { return fin != kNever && fin <= t; };
  long remaining = 3L * m * S;
  // Activations are released when W finishes; track pending releases per rank.
  std::vector<std::vector<long>> release(p);
  long t = 0;
  int idle_steps = 0;
  for (; remaining > 0; ++t) {
    if (idle_steps > 4) {  // unit actions: two idle steps in a row already mean a stall
      return absl::InternalError(
          absl::StrCat("zb-v: the greedy scheduler stalled for p=", p, " m=", m));
    }
    ++idle_steps;
    for (int r = 0; r < p; ++r) {
      auto& rel = release[r];
      for (auto it = rel.begin(); it != rel.end();) {
        if (*it <= t) {
          --inflight[r];
          it = rel.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (int r = 0; r < p; ++r) {
      const int deep = S - 1 - r, shallow = r;  // chunk 1 stage, chunk 0 stage
      const int i_order[2] = {policy.i_deep_first ? deep : shallow,
                              policy.i_deep_first ? shallow : deep};
      const int f_order[2] = {policy.f_deep_first ? deep : shallow,
                              policy.f_deep_first ? shallow : deep};
      Action pick{};
      bool found = false;
      auto try_i = [&] {
        for (int st : i_order) {  // I with its gradient present
          int mb = ni[st];
          if (found || mb >= nf[st] || !done_by(fin_f[idx(mb, st)], t)) continue;
          if (st + 1 < S && !done_by(fin_i[idx(mb, st + 1)], t)) continue;
          pick = Make(ActionKind::kI, st, mb);
          found = true;
        }
      };
      auto try_f = [&] {
        for (int st : f_order) {  // F with its input present, under the memory cap
          int mb = nf[st];
          if (found || mb >= m || inflight[r] >= cap) continue;
          if (st > 0 && !done_by(fin_f[idx(mb, st - 1)], t)) continue;
          pick = Make(ActionKind::kF, st, mb);
          found = true;
        }
      };
      if (policy.f_before_i) {
        try_f();
        try_i();
      } else {
        try_i();
        try_f();
      }
      if (!found) {  // oldest pending W
        int best = -1;
        for (int st : i_order) {
          int mb = nw[st];
          if (mb >= ni[st] || !done_by(fin_i[idx(mb, st)], t)) continue;
          if (best < 0 || mb < nw[best]) best = st;
        }
        if (best >= 0) {
          pick = Make(ActionKind::kW, best, nw[best]);
          found = true;
        }
      }
      if (!found) continue;
      idle_steps = 0;
      const int k = idx(pick.micro_batch, pick.virtual_stage);
      switch (pick.kind) {
        case ActionKind::kF:
          fin_f[k] = t + 1;
          ++nf[pick.virtual_stage];
          ++inflight[r];
          break;
        case ActionKind::kI:
          fin_i[k] = t + 1;
          ++ni[pick.virtual_stage];
          break;
        default:
          fin_w[k] = t + 1;
          ++nw[pick.virtual_stage];
          release[r].push_back(t + 1);
          break;
      }
      orders[r].push_back(pick);
      --remaining;
    }
  }
  return t;
}

// Runs every policy and keeps the shortest greedy timeline (ties: the first policy).
absl::Status GenZbV(Schedule& s) {
  const int p = s.spec.ranks, m = s.spec.micro_batches;
  long best = -1;
  absl::Status last = absl::OkStatus();
  for (int bits = 0; bits < 8; ++bits) {
    ZbVPolicy policy{(bits & 1) != 0, (bits & 2) == 0, (bits & 4) == 0};
    std::vector<std::vector<Action>> orders;
    absl::StatusOr<long> span = GreedyZbV(p, m, policy, orders);
    if (!span.ok()) {
      last = span.status();
      continue;
    }
    if (best < 0 || *span < best) {
      best = *span;
      for (int r = 0; r < p; ++r) s.programs[r].actions = std::move(orders[r]);
    }
  }
  if (best < 0) return last;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Schedule> GenerateSchedule(const ScheduleSpec& spec) {
  const int p = spec.ranks, m = spec.micro_batches;
  const char* name = ScheduleKindName(spec.kind);
  if (p < 1 || m < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " needs ranks >= 1 and micro-batches >= 1 (got p=", p, ", m=", m, ")"));
  }
  Schedule s;
  s.spec = spec;
  switch (spec.kind) {
    case ScheduleKind::kGpipe:
    case ScheduleKind::k1F1B:
    case ScheduleKind::kZbH1:
      if (spec.chunks != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, " runs one chunk per rank: chunks must be 1 (got ", spec.chunks,
                         "); use interleaved for several chunks per rank"));
      }
      break;
    case ScheduleKind::kInterleaved:
      if (spec.chunks < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("interleaved needs chunks >= 1 (got ", spec.chunks, ")"));
      }
      if (spec.chunks > 1 && m % p != 0) {
        int lo = (m / p) * p, hi = lo + p;
        std::string tries = lo > 0 ? absl::StrCat("m=", lo, " or ", hi) : absl::StrCat("m=", hi);
        return absl::InvalidArgumentError(absl::StrCat(
            "interleaved needs micro-batches to be a multiple of pipeline ranks (p=", p, "): try ",
            tries, " (or chunks=1)"));
      }
      break;
    case ScheduleKind::kZbV:
    case ScheduleKind::kDualPipeV:
      // chunks = 1 is the spec's default and means "the V's default", 2.
      if (spec.chunks != 1 && spec.chunks != 2) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, " runs exactly two chunks per rank in a V: chunks must be 2 (got ",
                         spec.chunks, ")"));
      }
      if (spec.kind == ScheduleKind::kDualPipeV && m < 2 * p) {
        return absl::InvalidArgumentError(
            absl::StrCat("dualpipev needs micro-batches >= 2 x pipeline ranks (p=", p,
                         "): got m=", m, ", try m=", 2 * p, " (or zb-v, which runs any m)"));
      }
      s.spec.chunks = 2;
      break;
    case ScheduleKind::kCustom:
      return absl::InvalidArgumentError(
          "custom schedules are not generated: write them in the text form and use "
          "ParseSchedule");
  }
  const int v = s.spec.chunks;                  // >= 1 here
  if (int64_t{p} * m > kMaxScheduleSize / v) {  // (p x m x v itself could overflow)
    return absl::InvalidArgumentError(
        absl::StrCat(name, " with p=", p, " ranks, m=", m, " micro-batches and v=", v,
                     " chunks is too large: p x m x v must be at most ", kMaxScheduleSize));
  }
  s.num_stages = p * v;
  for (int st = 0; st < s.num_stages; ++st) s.stage_rank.push_back(StageRank(s.spec, st));
  s.programs.resize(p);
  for (int r = 0; r < p; ++r) s.programs[r].rank = r;
  switch (spec.kind) {
    case ScheduleKind::kGpipe:
      GenGpipe(s);
      break;
    case ScheduleKind::k1F1B:
      Gen1F1B(s);
      break;
    case ScheduleKind::kInterleaved:
      if (s.spec.chunks == 1) {
        Gen1F1B(s);
      } else {
        GenInterleaved(s);
      }
      break;
    case ScheduleKind::kZbH1:
      s.split_backward = true;
      GenZbH1(s);
      break;
    case ScheduleKind::kZbV:
      s.split_backward = true;
      PW_RETURN_IF_ERROR(GenZbV(s));
      break;
    case ScheduleKind::kDualPipeV:
      s.split_backward = true;
      GenDualPipeV(s);
      break;
    default:
      break;
  }
  return s;
}

}  // namespace pipewright

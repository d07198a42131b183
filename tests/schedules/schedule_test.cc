// Schedules: action text form, generators (with their oracles), lowering and the validator.
#include "pipewright/schedule.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "pipewright/simulator.h"

namespace pipewright {
namespace {

constexpr ScheduleKind kGenerated[] = {ScheduleKind::kGpipe,       ScheduleKind::k1F1B,
                                       ScheduleKind::kInterleaved, ScheduleKind::kZbH1,
                                       ScheduleKind::kZbV,         ScheduleKind::kDualPipeV};

ScheduleSpec Spec(ScheduleKind k, int p, int m, int v = 1) {
  ScheduleSpec s;
  s.kind = k;
  s.ranks = p;
  s.micro_batches = m;
  s.chunks = v;
  return s;
}

Schedule Lowered(const ScheduleSpec& spec) {
  auto s = GenerateSchedule(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  Schedule out = *s;
  EXPECT_TRUE(LowerComm(out).ok());
  return out;
}

// Peak micro-batches (chunk units) in flight per rank, in program order: +1 at F, -1 at the
// action that ends the backward (B, or W when split).
std::vector<int> PeakInFlight(const Schedule& s) {
  std::vector<int> peak;
  for (const Program& prog : s.programs) {
    int cur = 0, best = 0;
    for (const Action& a : prog.actions) {
      if (a.kind == ActionKind::kF) best = std::max(best, ++cur);
      if (a.kind == ActionKind::kB || a.kind == ActionKind::kW) --cur;
    }
    peak.push_back(best);
  }
  return peak;
}

// Runs the project's simulator with costs given per action (not per stage): the simulator
// divides per-stage costs by v for each chunk, so they are scaled up by v here. `b` is the cost
// of a B action (unsplit schedules), `i` and `w` those of I and W (split ones). Returns makespan
// -1 when the schedule cannot complete.
struct Sim {
  double makespan = 0;
  std::vector<double> busy;
};
Sim Simulate(const Schedule& s, double f, double b, double i, double w) {
  const double v = std::max(1, s.spec.chunks);
  SimCosts costs;
  costs.f = f * v;
  costs.b = (s.split_backward ? i : b) * v;
  costs.w = s.split_backward ? w * v : 0.0;
  Sim out;
  absl::StatusOr<SimResult> r = pipewright::Simulate(s, costs);
  if (!r.ok()) {
    out.makespan = -1;
    return out;
  }
  out.makespan = r->makespan;
  for (const SimRank& rank : r->ranks) out.busy.push_back(rank.busy);
  return out;
}

bool Refusable(const ScheduleSpec& spec) {
  return (spec.kind == ScheduleKind::kInterleaved && spec.chunks > 1 &&
          spec.micro_batches % spec.ranks != 0) ||
         (spec.kind == ScheduleKind::kDualPipeV && spec.micro_batches < 2 * spec.ranks);
}

TEST(ActionTest, ToStringAndParseRoundTrip) {
  for (int k = 0; k <= static_cast<int>(ActionKind::kOptimizerStep); ++k) {
    Action a{static_cast<ActionKind>(k), 3, 7};
    if (a.kind == ActionKind::kReduceGrads) a.micro_batch = 0;
    if (a.kind == ActionKind::kOptimizerStep) a = Action{a.kind, 0, 0};
    auto parsed = ParseAction(a.ToString());
    ASSERT_TRUE(parsed.ok()) << a.ToString() << ": " << parsed.status();
    EXPECT_EQ(*parsed, a) << a.ToString();
    EXPECT_TRUE(IsCompute(a.kind) != IsComm(a.kind) || k >= 8);
  }
  EXPECT_EQ(Action({ActionKind::kF, 1, 3}).ToString(), "F3@s1");
  EXPECT_EQ(Action({ActionKind::kSendB, 2, 0}).ToString(), "SEND_B0@s2");
  EXPECT_EQ(Action({ActionKind::kReduceGrads, 1, 0}).ToString(), "REDUCE_GRADS@s1");
  EXPECT_EQ(Action({ActionKind::kOptimizerStep, 0, 0}).ToString(), "OPTIMIZER_STEP");
}

TEST(ActionTest, ParseActionRejectsJunk) {
  for (const char* junk : {"X3@s1", "F@s1", "F3@", "F-1@s0", "F3@1", "F3s1", "", "F3@s",
                           "OPTIMIZER_STEP3", "REDUCE_GRADS2@s1", "F3@s1x", "RECV_F@s2"}) {
    auto a = ParseAction(junk);
    EXPECT_FALSE(a.ok()) << junk;
    if (!a.ok()) {
      EXPECT_NE(a.status().message().find("bad action"), std::string::npos);
    }
  }
}

TEST(ActionTest, ScheduleKindNames) {
  for (ScheduleKind k : kGenerated) {
    auto parsed = ParseScheduleKind(ScheduleKindName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  EXPECT_EQ(*ParseScheduleKind("custom"), ScheduleKind::kCustom);
  EXPECT_STREQ(ScheduleKindName(ScheduleKind::kZbH1), "zb-h1");
  EXPECT_FALSE(ParseScheduleKind("pipedream").ok());
}

TEST(ActionTest, StagePlacement) {
  EXPECT_EQ(StageRank(Spec(ScheduleKind::kInterleaved, 4, 8, 2), 5), 1);
  EXPECT_EQ(StageRank(Spec(ScheduleKind::kZbV, 4, 8, 2), 3), 3);
  EXPECT_EQ(StageRank(Spec(ScheduleKind::kZbV, 4, 8, 2), 4), 3);
  EXPECT_EQ(StageRank(Spec(ScheduleKind::kZbV, 4, 8, 2), 7), 0);
  EXPECT_EQ(StageRank(Spec(ScheduleKind::k1F1B, 4, 8), 2), 2);
}

// Every kind, p in 1..8, m in 1..32: generated (or refused with a message), lowered,
// validated, and its text form parses back to the same programs.
TEST(GeneratorTest, AllKindsValidateAndRoundTrip) {
  int validated = 0;
  for (ScheduleKind kind : kGenerated) {
    for (int v : {1, 2, 3}) {
      if (v > 1 && kind != ScheduleKind::kInterleaved) continue;
      for (int p = 1; p <= 8; ++p) {
        for (int m = 1; m <= 32; ++m) {
          ScheduleSpec spec = Spec(kind, p, m, IsVShaped(kind) ? 2 : v);
          auto gen = GenerateSchedule(spec);
          std::string what = absl::StrCat(ScheduleKindName(kind), " p=", p, " m=", m, " v=", v);
          if (!gen.ok()) {
            EXPECT_TRUE(Refusable(spec)) << what << ": " << gen.status();
            EXPECT_FALSE(gen.status().message().empty());
            continue;
          }
          Schedule s = *gen;
          EXPECT_FALSE(s.lowered);
          EXPECT_EQ(s.split_backward, kind == ScheduleKind::kZbH1 || IsVShaped(kind));
          auto text0 = ParseSchedule(ToText(s), s.spec);
          ASSERT_TRUE(text0.ok()) << what << ": " << text0.status();
          EXPECT_FALSE(text0->lowered);
          ASSERT_TRUE(LowerComm(s).ok()) << what;
          EXPECT_FALSE(LowerComm(s).ok()) << "lowering twice must fail";
          absl::Status st = Validate(s);
          ASSERT_TRUE(st.ok()) << what << ": " << st << "\n" << ToText(s);
          auto back = ParseSchedule(ToText(s), s.spec);
          ASSERT_TRUE(back.ok()) << what << ": " << back.status();
          EXPECT_TRUE(back->lowered);
          EXPECT_EQ(back->split_backward, s.split_backward);
          EXPECT_EQ(back->num_stages, s.num_stages);
          EXPECT_EQ(back->stage_rank, s.stage_rank);
          ASSERT_EQ(back->programs.size(), s.programs.size());
          for (size_t r = 0; r < s.programs.size(); ++r) {
            EXPECT_EQ(back->programs[r].actions, s.programs[r].actions) << what << " rank " << r;
          }
          EXPECT_GE(Simulate(s, 1, 2, 1, 1).makespan, 0) << what;
          ++validated;
        }
      }
    }
  }
  EXPECT_GT(validated, 1000);
}

TEST(GeneratorTest, InterleavedRefusalSaysWhatWorks) {
  auto s = GenerateSchedule(Spec(ScheduleKind::kInterleaved, 4, 10, 2));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("multiple of pipeline ranks (p=4): try m=8 or 12"),
            std::string::npos)
      << s.status();
  auto small = GenerateSchedule(Spec(ScheduleKind::kInterleaved, 4, 3, 2));
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("try m=4"), std::string::npos) << small.status();
}

TEST(GeneratorTest, BadSpecsAreRefused) {
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::k1F1B, 0, 4)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::k1F1B, 4, 0)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::k1F1B, 4, 4, 2)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::kGpipe, 4, 4, 2)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::kZbH1, 4, 4, 3)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::kZbV, 4, 8, 3)).ok());
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::kCustom, 4, 8)).ok());
  auto zbv = GenerateSchedule(Spec(ScheduleKind::kZbV, 4, 8, 1));  // default chunks -> 2
  ASSERT_TRUE(zbv.ok());
  EXPECT_EQ(zbv->spec.chunks, 2);
  EXPECT_EQ(zbv->num_stages, 8);
  EXPECT_FALSE(GenerateSchedule(Spec(ScheduleKind::kDualPipeV, 4, 8, 3)).ok());
  auto few = GenerateSchedule(Spec(ScheduleKind::kDualPipeV, 4, 7));
  ASSERT_FALSE(few.ok());
  EXPECT_NE(few.status().message().find("micro-batches >= 2 x pipeline ranks (p=4): got m=7, "
                                        "try m=8"),
            std::string::npos)
      << few.status();
  auto dpv = GenerateSchedule(Spec(ScheduleKind::kDualPipeV, 4, 8, 1));  // default chunks -> 2
  ASSERT_TRUE(dpv.ok()) << dpv.status();
  EXPECT_EQ(dpv->num_stages, 8);
  EXPECT_EQ(dpv->stage_rank, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
}

TEST(GeneratorTest, SchedulesAboveTheSizeLimitAreRefused) {
  // p x m x v <= kMaxScheduleSize = 2^20; refused before anything is generated.
  for (const ScheduleSpec& spec :
       {Spec(ScheduleKind::k1F1B, 1, (1 << 20) + 1), Spec(ScheduleKind::kGpipe, 64, 1 << 20),
        Spec(ScheduleKind::kInterleaved, 1024, 1024, 2),
        Spec(ScheduleKind::kZbV, 2, (1 << 18) + 1, 1),  // chunks 1 means the V's 2
        Spec(ScheduleKind::kInterleaved, 65536, 65536, 65536)}) {
    absl::StatusOr<Schedule> s = GenerateSchedule(spec);
    ASSERT_FALSE(s.ok()) << spec.ranks << " x " << spec.micro_batches;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("p x m x v must be at most 1048576"), std::string::npos)
        << s.status();
  }
  EXPECT_TRUE(GenerateSchedule(Spec(ScheduleKind::k1F1B, 1, 1 << 20)).ok());  // at the limit
}

TEST(GeneratorTest, PeakInFlight1F1BAndGpipe) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      auto one = PeakInFlight(*GenerateSchedule(Spec(ScheduleKind::k1F1B, p, m)));
      auto gp = PeakInFlight(*GenerateSchedule(Spec(ScheduleKind::kGpipe, p, m)));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(one[r], std::min(m, p - r)) << "p=" << p << " m=" << m << " r=" << r;
        EXPECT_EQ(gp[r], m);
      }
    }
  }
}

TEST(GeneratorTest, OneFOneBMakespan) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 24; ++m) {
      Schedule s = Lowered(Spec(ScheduleKind::k1F1B, p, m));
      EXPECT_DOUBLE_EQ(Simulate(s, 1, 2, 0, 0).makespan, 3.0 * (m + p - 1));
    }
  }
}

TEST(GeneratorTest, InterleavedWithOneChunkIs1F1B) {
  for (int p = 1; p <= 6; ++p) {
    for (int m = 1; m <= 12; ++m) {
      auto a = GenerateSchedule(Spec(ScheduleKind::kInterleaved, p, m, 1));
      auto b = GenerateSchedule(Spec(ScheduleKind::k1F1B, p, m, 1));
      ASSERT_TRUE(a.ok() && b.ok());
      for (int r = 0; r < p; ++r) EXPECT_EQ(a->programs[r].actions, b->programs[r].actions);
    }
  }
}

// Equal stage costs (a chunk costs 1/v): bubble (p-1)/(v m + p-1); rank-0 peak
// p + (p-1)/v whole stages once the steady state is reached (m >= 2p).
TEST(GeneratorTest, InterleavedOracle) {
  for (int v = 2; v <= 4; ++v) {
    for (int p = 2; p <= 8; ++p) {
      for (int m = p; m <= 32; m += p) {
        Schedule s = Lowered(Spec(ScheduleKind::kInterleaved, p, m, v));
        for (double bcost : {1.0, 2.0}) {
          Sim sim = Simulate(s, 1.0 / v, bcost / v, 0, 0);
          double busy = m * (1.0 + bcost);
          double bubble = 1.0 - busy / sim.makespan;
          EXPECT_NEAR(bubble, (p - 1.0) / (v * m + p - 1.0), 1e-9)
              << "p=" << p << " m=" << m << " v=" << v << " b=" << bcost;
        }
        if (m >= 2 * p) {
          EXPECT_NEAR(PeakInFlight(s)[0] / static_cast<double>(v), p + (p - 1.0) / v, 1e-9)
              << "p=" << p << " m=" << m << " v=" << v;
        }
      }
    }
  }
}

// ZB-H1 with F = I = W = 1: makespan 3m + p - 1 for m >= p; memory at most 1F1B's peak.
TEST(GeneratorTest, ZbH1Oracle) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      Schedule s = Lowered(Spec(ScheduleKind::kZbH1, p, m));
      double ms = Simulate(s, 1, 0, 1, 1).makespan;
      if (m >= p) {
        EXPECT_DOUBLE_EQ(ms, 3.0 * m + p - 1) << "p=" << p << " m=" << m;
      }
      EXPECT_LE(ms, 3.0 * (m + p - 1)) << "never worse than 1F1B";
      for (int peak : PeakInFlight(s)) EXPECT_LE(peak, std::min(m, p));
      EXPECT_EQ(PeakInFlight(s)[0], std::min(m, p));
    }
  }
}

// ZB-V with F = I = W = 1 per whole stage (1/2 per chunk): memory within 1F1B's rank-0
// peak (p stages = 2p chunks) on every rank, and for m >= 2p the makespan is the ideal
// 3m + (p-1)/2: every rank busy all the time except the unavoidable ramp of the middle
// rank, which cannot start before (p-1) chunk forwards have run.
TEST(GeneratorTest, ZbVMemoryAndMakespan) {
  for (int p = 1; p <= 10; ++p) {
    for (int m = 1; m <= 40; ++m) {
      Schedule s = Lowered(Spec(ScheduleKind::kZbV, p, m, 2));
      for (int peak : PeakInFlight(s)) EXPECT_LE(peak, 2 * p);
      double ms = Simulate(s, 0.5, 0, 0.5, 0.5).makespan;
      double ideal = 3.0 * m + (p - 1) * 0.5;
      EXPECT_GE(ms, ideal - 1e-9);
      if (m >= 2 * p) {
        EXPECT_DOUBLE_EQ(ms, ideal) << "p=" << p << " m=" << m;
      }
      if (m >= p) {
        EXPECT_LE(ms, 3.0 * m + p - 1) << "p=" << p << " m=" << m << ": no worse than ZB-H1";
      }
    }
  }
}

// DualPipeV (Note [DualPipeV]) with F = I = W = 1 per whole stage: the phase structure as
// DeepSeek describes it (rank r starts with 2(p - r - 1) + 1 chunk-0 forwards, ends with W's),
// every rank runs each chunk's F, I and W in micro-batch order, the peak in flight per rank
// is at most the 2p chunks (p whole stages) of zb-v's cap plus one, and the bubble is below
// 1F1B's at every p and m >= 2p.
TEST(GeneratorTest, DualPipeVShapeMemoryAndBubble) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 2 * p; m <= 4 * p + 3; ++m) {
      const std::string what = absl::StrCat("p=", p, " m=", m);
      auto gen = GenerateSchedule(Spec(ScheduleKind::kDualPipeV, p, m));
      ASSERT_TRUE(gen.ok()) << what << ": " << gen.status();
      for (const Program& prog : gen->programs) {
        const int r = prog.rank;
        int lead = 0;
        while (prog.actions[lead].kind == ActionKind::kF && prog.actions[lead].virtual_stage == r)
          ++lead;
        EXPECT_EQ(lead, 2 * (p - r - 1) + 1) << what << " rank " << r;
        EXPECT_EQ(prog.actions.back().kind, ActionKind::kW) << what << " rank " << r;
        int next[3][2] = {};  // per kind (F, I, W) and chunk: the next micro-batch
        for (const Action& a : prog.actions) {
          const int kind = a.kind == ActionKind::kF ? 0 : a.kind == ActionKind::kI ? 1 : 2;
          const int chunk = a.virtual_stage == r ? 0 : 1;
          EXPECT_EQ(a.micro_batch, next[kind][chunk]++)
              << what << " rank " << r << " " << a.ToString();
        }
      }
      Schedule s = Lowered(Spec(ScheduleKind::kDualPipeV, p, m));
      for (int peak : PeakInFlight(s)) EXPECT_LE(peak, 2 * p + 1) << what;
      auto dpv = Simulate(s, 0.5, 0, 0.5, 0.5);
      auto base = Simulate(Lowered(Spec(ScheduleKind::k1F1B, p, m)), 1, 2, 1, 1);
      if (p > 1) {
        EXPECT_LT(dpv.makespan, base.makespan) << what;
      }
    }
  }
}

TEST(LowerTest, InsertsCommAndFinalActions) {
  Schedule s = Lowered(Spec(ScheduleKind::k1F1B, 2, 2));
  EXPECT_EQ(ToText(s).substr(ToText(s).find("rank 0")),
            "rank 0: F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0 "
            "REDUCE_GRADS@s0 OPTIMIZER_STEP\n"
            "rank 1: RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1 "
            "REDUCE_GRADS@s1 OPTIMIZER_STEP\n");
  Schedule z = Lowered(Spec(ScheduleKind::kZbH1, 2, 1));
  EXPECT_EQ(ToText(z).substr(ToText(z).find("rank 0")),
            "rank 0: F0@s0 SEND_F0@s0 RECV_B0@s0 I0@s0 W0@s0 REDUCE_GRADS@s0 OPTIMIZER_STEP\n"
            "rank 1: RECV_F0@s1 F0@s1 I0@s1 SEND_B0@s1 W0@s1 REDUCE_GRADS@s1 OPTIMIZER_STEP\n");
}

// Hand-written programs in the text form.
absl::Status CheckText(const std::string& text, int p, int m) {
  auto s = ParseSchedule(text, Spec(ScheduleKind::kCustom, p, m));
  if (!s.ok()) return s.status();
  return Validate(*s);
}

TEST(ValidateTest, HandWrittenGoodProgram) {
  EXPECT_TRUE(CheckText("# two ranks, one micro-batch\n"
                        "rank 0: F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0   # stage 0\n"
                        "\n"
                        "rank 1: RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n",
                        2, 1)
                  .ok());
}

TEST(ValidateTest, MissingSendDeadlocksAndNamesTheWaiter) {
  Schedule s = Lowered(Spec(ScheduleKind::k1F1B, 4, 8));
  auto& acts = s.programs[1].actions;
  // The last send: the receiver waits forever.
  auto it = std::find(acts.begin(), acts.end(), Action{ActionKind::kSendF, 1, 7});
  ASSERT_NE(it, acts.end());
  acts.erase(it);
  absl::Status st = Validate(s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("deadlock: "), std::string::npos) << st;
  EXPECT_NE(st.message().find("rank 2 waits on RECV_F7@s2"), std::string::npos) << st;
  // An earlier send: the receiver finds the next micro-batch at the head of the channel.
  Schedule s2 = Lowered(Spec(ScheduleKind::k1F1B, 4, 8));
  auto& a2 = s2.programs[1].actions;
  a2.erase(std::find(a2.begin(), a2.end(), Action{ActionKind::kSendF, 1, 3}));
  EXPECT_EQ(Validate(s2).message(),
            "rank 2 expects RECV_F3@s2 but the channel from rank 1 holds SEND_F4@s1");
}

TEST(ValidateTest, BothReceiveFirstDeadlockNamesBoth) {
  // Rank 0 waits for a gradient before sending its activation; rank 1 waits for the activation.
  absl::Status st = CheckText(
      "rank 0: RECV_B0@s0 F0@s0 SEND_F0@s0 B0@s0\n"
      "rank 1: RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n",
      2, 1);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "deadlock: rank 0 waits on RECV_B0@s0; rank 1 waits on RECV_F0@s1");
  // Swapping two ranks' steady-state pairs in a generated schedule deadlocks as well.
  Schedule s = Lowered(Spec(ScheduleKind::kGpipe, 3, 2));
  auto& a1 = s.programs[1].actions;
  std::rotate(a1.begin(), a1.begin() + 6, a1.end() - 2);  // rank 1 starts with its backward
  absl::Status st2 = Validate(s);
  ASSERT_FALSE(st2.ok());
  EXPECT_NE(st2.message().find("deadlock"), std::string::npos) << st2;
  EXPECT_NE(st2.message().find("rank 1 waits on RECV_B"), std::string::npos) << st2;
  EXPECT_NE(st2.message().find("rank 2 waits on RECV_F"), std::string::npos) << st2;
}

TEST(ValidateTest, WrongHeadOfLineMessage) {
  absl::Status st = CheckText(
      "rank 0: F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0\n"
      "rank 1: RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1 RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n",
      2, 2);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "rank 1 expects RECV_F1@s1 but the channel from rank 0 holds SEND_F0@s0");
}

TEST(ValidateTest, DuplicateForward) {
  absl::Status st = CheckText("rank 0: F0@s0 F0@s0 B0@s0\n", 1, 1);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rank 0 F0@s0: duplicate forward"), std::string::npos) << st;
}

TEST(ValidateTest, WBeforeI) {
  absl::Status st = CheckText("rank 0: F0@s0 W0@s0 I0@s0\n", 1, 1);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rank 0 W0@s0: W before I0@s0"), std::string::npos) << st;
}

TEST(ValidateTest, OtherBreakages) {
  // Backward before forward.
  EXPECT_NE(CheckText("rank 0: B0@s0 F0@s0\n", 1, 1).message().find("backward before its forward"),
            std::string::npos);
  // Missing backward.
  absl::Status miss = CheckText("rank 0: F0@s0 F1@s0 B0@s0\n", 1, 2);
  EXPECT_NE(miss.message().find("missing actions"), std::string::npos) << miss;
  EXPECT_NE(miss.message().find("B1@s0"), std::string::npos) << miss;
  // Missing W after I.
  EXPECT_NE(CheckText("rank 0: F0@s0 I0@s0\n", 1, 1).message().find("W0@s0"), std::string::npos);
  // Unreceived message.
  absl::Status left = CheckText(
      "rank 0: F0@s0 SEND_F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0\n"
      "rank 1: RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n",
      2, 1);
  EXPECT_FALSE(left.ok());
  // Forward without its input (unlowered multi-rank program).
  auto un = GenerateSchedule(Spec(ScheduleKind::k1F1B, 2, 2));
  absl::Status st = Validate(*un);
  EXPECT_NE(st.message().find("is not available"), std::string::npos) << st;
  // REDUCE_GRADS too early.
  EXPECT_NE(CheckText("rank 0: F0@s0 F1@s0 B0@s0 REDUCE_GRADS@s0 B1@s0\n", 1, 2)
                .message()
                .find("REDUCE_GRADS@s0: runs before the weight gradient of micro-batch 1"),
            std::string::npos);
}

TEST(ParseScheduleTest, ErrorsNameLineAndToken) {
  ScheduleSpec spec = Spec(ScheduleKind::kCustom, 2, 2);
  auto junk = ParseSchedule("rank 0: F0@s0\n# c\nrank 1: F0@s1 X3@s1\n", spec);
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.status().message().find("line 3"), std::string::npos) << junk.status();
  EXPECT_NE(junk.status().message().find("X3@s1"), std::string::npos) << junk.status();
  auto owner = ParseSchedule("rank 0: F0@s1\n", spec);
  ASSERT_FALSE(owner.ok());
  EXPECT_NE(owner.status().message().find("belongs to rank 1"), std::string::npos);
  EXPECT_FALSE(ParseSchedule("rank 2: F0@s0\n", spec).ok());
  EXPECT_FALSE(ParseSchedule("rank 0: F2@s0\n", spec).ok());
  EXPECT_FALSE(ParseSchedule("rank 0: F0@s5\n", spec).ok());
  EXPECT_FALSE(ParseSchedule("rank 0: F0@s0\nrank 0: B0@s0\n", spec).ok());
  EXPECT_FALSE(ParseSchedule("ranks 0 F0@s0\n", spec).ok());
  auto ok = ParseSchedule("rank 1: F0@s1 I0@s1 W0@s1\n", spec);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->split_backward);
  EXPECT_FALSE(ok->lowered);
  EXPECT_TRUE(ok->programs[0].actions.empty());
}

}  // namespace
}  // namespace pipewright

namespace pipewright {
namespace {

// A transport without tags (NCCL) matches messages in posting order: the engine checks that a
// schedule allows it before running it there. 1F1B, GPipe and ZB-H1 do; the check must also be
// able to fail.
TEST(FifoOrder, OneFOneBPassesAndASwappedReceiveFails) {
  for (ScheduleKind k : {ScheduleKind::k1F1B, ScheduleKind::kGpipe, ScheduleKind::kZbH1}) {
    auto s = GenerateSchedule({k, 4, 8, 1});
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(LowerComm(*s).ok());
    EXPECT_TRUE(CheckFifoOrder(*s).ok()) << ScheduleKindName(k) << ": " << CheckFifoOrder(*s);
  }
  auto s = GenerateSchedule({ScheduleKind::kGpipe, 2, 4, 1});
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(LowerComm(*s).ok());
  // Rank 1 receives micro-batches 0 and 1 in swapped order.
  std::vector<Action>& acts = s->programs[1].actions;
  std::vector<size_t> recvs;
  for (size_t i = 0; i < acts.size(); ++i) {
    if (acts[i].kind == ActionKind::kRecvF) recvs.push_back(i);
  }
  ASSERT_GE(recvs.size(), 2u);
  std::swap(acts[recvs[0]].micro_batch, acts[recvs[1]].micro_batch);
  absl::Status st = CheckFifoOrder(*s);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("pipeline rank 0 to 1"), std::string::npos) << st;
}

// Message tags are distinct for every (micro-batch, stage, direction) of a step.
TEST(FifoOrder, MessageTagsAreDistinct) {
  std::vector<int64_t> tags;
  for (int mb = 0; mb < 5; ++mb) {
    for (int s = 0; s < 6; ++s) {
      for (bool fwd : {true, false}) tags.push_back(MessageTag(6, mb, s, fwd));
    }
  }
  std::sort(tags.begin(), tags.end());
  EXPECT_EQ(std::adjacent_find(tags.begin(), tags.end()), tags.end());
}

// A hand-written program reads its ranks, stages and micro-batches from the text.
TEST(ParseProgram, InfersTheShapeAndMatchesTheGenerator) {
  auto gen = GenerateSchedule({ScheduleKind::k1F1B, 2, 4, 1});
  ASSERT_TRUE(gen.ok());
  auto parsed = ParseProgram(ToText(*gen));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.kind, ScheduleKind::kCustom);
  EXPECT_EQ(parsed->spec.ranks, 2);
  EXPECT_EQ(parsed->spec.micro_batches, 4);
  EXPECT_EQ(parsed->num_stages, 2);
  EXPECT_FALSE(parsed->lowered);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(parsed->programs[r].actions, gen->programs[r].actions);
  // Interleaved placement: four stages on two ranks.
  auto two = ParseProgram("rank 0: F0@s0 F0@s2 B0@s2 B0@s0\nrank 1: F0@s1 F0@s3 B0@s3 B0@s1\n");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->spec.chunks, 2);
  EXPECT_EQ(two->num_stages, 4);
}

TEST(ParseProgram, NamesWhatIsWrong) {
  EXPECT_NE(ParseProgram("# nothing\n").status().message().find("no 'rank R"), std::string::npos);
  EXPECT_NE(ParseProgram("rank 1: F0@s1 B0@s1\n").status().message().find("rank lines"),
            std::string::npos);
  EXPECT_NE(ParseProgram("rank 0: F0@s0 B0@s0\nrank 1: F0@s2 B0@s2\n")
                .status()
                .message()
                .find("multiple of the ranks"),
            std::string::npos);
  absl::Status bad = ParseProgram("rank 0: F0@s0 X1@s0\n").status();
  EXPECT_NE(bad.message().find("line 1"), std::string::npos) << bad;
}

// A step of more (stage, micro-batch) pairs than a plan may schedule is refused before the
// programs are built (issue 34: a 58 MB program of 2.5M micro-batches grew train to 18 GB).
TEST(ParseProgram, BoundsTheStageMicroBatchPairs) {
  std::string text = "rank 0:";
  for (int64_t i = 0; i <= kMaxStageMicroBatches; ++i) absl::StrAppend(&text, " F", i, "@s0");
  absl::Status over = ParseProgram(text).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(over.message(),
            "the program runs 1 stages x 1048577 micro-batches = 1048577 (stage, micro-batch) "
            "pairs; a program has at most 1048576");
  // One micro-batch fewer is read (and then refused by the validator for what it is).
  text.resize(text.rfind(' '));
  EXPECT_TRUE(ParseProgram(text).ok());
}

}  // namespace
}  // namespace pipewright

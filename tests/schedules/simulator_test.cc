// Simulator and exporters: hand-built programs with exact timings, deadlock reports, memory
// counting, trace/SVG structure, and the closed-form bubbles of the generated schedules.
#include "pipewright/simulator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "pipewright/schedule.h"

namespace pipewright {
namespace {

// Actions built directly, so these tests do not depend on the text form.
Action A(ActionKind kind, int mb, int stage) {
  Action a;
  a.kind = kind;
  a.micro_batch = mb;
  a.virtual_stage = stage;
  return a;
}

using K = ActionKind;

// p ranks, one stage each (stage s on rank s), lowered.
Schedule HandBuilt(std::vector<std::vector<Action>> programs, bool split = false) {
  Schedule s;
  const int p = static_cast<int>(programs.size());
  s.spec.kind = ScheduleKind::kCustom;
  s.spec.ranks = p;
  s.spec.micro_batches = 2;
  s.spec.chunks = 1;
  s.num_stages = p;
  for (int r = 0; r < p; ++r) s.stage_rank.push_back(r);
  s.split_backward = split;
  s.lowered = true;
  for (int r = 0; r < p; ++r) {
    Program prog;
    prog.rank = r;
    prog.actions = std::move(programs[r]);
    s.programs.push_back(std::move(prog));
  }
  return s;
}

// Two ranks, two micro-batches, 1F1B-like order.
Schedule TwoRank() {
  return HandBuilt({
      {A(K::kF, 0, 0), A(K::kSendF, 0, 0), A(K::kF, 1, 0), A(K::kSendF, 1, 0), A(K::kRecvB, 0, 0),
       A(K::kB, 0, 0), A(K::kRecvB, 1, 0), A(K::kB, 1, 0)},
      {A(K::kRecvF, 0, 1), A(K::kF, 0, 1), A(K::kB, 0, 1), A(K::kSendB, 0, 1), A(K::kRecvF, 1, 1),
       A(K::kF, 1, 1), A(K::kB, 1, 1), A(K::kSendB, 1, 1)},
  });
}

SimCosts Costs(double f, double b, double w = 0) {
  SimCosts c;
  c.f = f;
  c.b = b;
  c.w = w;
  return c;
}

const SimEvent* Find(const SimResult& r, int rank, const std::string& text) {
  for (const SimEvent& e : r.timeline) {
    if (e.rank == rank && e.action.ToString() == text) return &e;
  }
  return nullptr;
}

int Count(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t pos = hay.find(needle); pos != std::string::npos;
       pos = hay.find(needle, pos + needle.size())) {
    ++n;
  }
  return n;
}

TEST(Simulator, TwoRankExactTimes) {
  auto r = Simulate(TwoRank(), Costs(1, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->makespan, 9);
  ASSERT_EQ(r->ranks.size(), 2u);
  EXPECT_DOUBLE_EQ(r->ranks[0].busy, 6);
  EXPECT_DOUBLE_EQ(r->ranks[1].busy, 6);
  EXPECT_NEAR(r->bubble_fraction, 1.0 / 3.0, 1e-12);
  const SimEvent* b1 = Find(*r, 0, "B1@s0");
  ASSERT_NE(b1, nullptr);
  EXPECT_DOUBLE_EQ(b1->start, 7);
  EXPECT_DOUBLE_EQ(b1->end, 9);
  const SimEvent* f1 = Find(*r, 1, "F1@s1");
  ASSERT_NE(f1, nullptr);
  EXPECT_DOUBLE_EQ(f1->start, 4);
  EXPECT_EQ(r->timeline.size(), 16u);
  // Sorted by (rank, start).
  for (size_t i = 1; i < r->timeline.size(); ++i) {
    const SimEvent& a = r->timeline[i - 1];
    const SimEvent& b = r->timeline[i];
    EXPECT_TRUE(a.rank < b.rank || (a.rank == b.rank && a.start <= b.start)) << i;
  }
}

TEST(Simulator, CommLatencyDelaysReceive) {
  SimCosts c = Costs(1, 2);
  c.comm_latency = 0.25;
  c.message_bytes = 100;
  c.comm_per_byte = 0.0025;  // 0.25 + 0.25 = 0.5 per message
  auto r = Simulate(TwoRank(), c);
  ASSERT_TRUE(r.ok()) << r.status();
  const SimEvent* recv = Find(*r, 1, "RECV_F0@s1");
  ASSERT_NE(recv, nullptr);
  EXPECT_DOUBLE_EQ(recv->start, 0);  // the event spans the wait
  EXPECT_DOUBLE_EQ(recv->end, 1.5);
  EXPECT_DOUBLE_EQ(Find(*r, 1, "F0@s1")->start, 1.5);
  EXPECT_DOUBLE_EQ(Find(*r, 0, "B0@s0")->start, 5.0);
  EXPECT_DOUBLE_EQ(r->makespan, 10);
  // Busy time excludes waiting.
  EXPECT_DOUBLE_EQ(r->ranks[0].busy, 6);
}

TEST(Simulator, PerStageCostsOverride) {
  SimCosts c = Costs(1, 2);
  c.stage_f = {1, 3};
  c.stage_b = {2, 1};
  c.stage_w = {0, 0};
  auto r = Simulate(TwoRank(), c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(Find(*r, 1, "F0@s1")->end, 4);  // 1 + 3
  EXPECT_DOUBLE_EQ(Find(*r, 1, "B0@s1")->end, 5);  // + 1
  c.stage_f = {1};
  EXPECT_FALSE(Simulate(TwoRank(), c).ok());
}

TEST(Simulator, ReduceAndOptimizerCountAsBusy) {
  Schedule s = HandBuilt(
      {{A(K::kF, 0, 0), A(K::kB, 0, 0), A(K::kReduceGrads, 0, 0), A(K::kOptimizerStep, 0, 0)}});
  SimCosts c = Costs(1, 1);
  c.reduce_time = 0.5;
  c.optimizer_time = 0.25;
  auto r = Simulate(s, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->makespan, 2.75);
  EXPECT_DOUBLE_EQ(r->ranks[0].busy, 2.75);
  EXPECT_DOUBLE_EQ(r->bubble_fraction, 0);
}

TEST(Simulator, DeadlockNamesEveryBlockedRank) {
  Schedule s = HandBuilt({
      {A(K::kRecvB, 0, 0), A(K::kF, 0, 0), A(K::kSendF, 0, 0), A(K::kB, 0, 0)},
      {A(K::kRecvF, 0, 1), A(K::kF, 0, 1), A(K::kB, 0, 1), A(K::kSendB, 0, 1)},
  });
  auto r = Simulate(s, Costs(1, 1));
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0 waits on RECV_B0@s0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1 waits on RECV_F0@s1"), std::string::npos) << msg;
}

TEST(Simulator, ReceiveWithoutSendIsAnError) {
  Schedule s = HandBuilt({
      {A(K::kF, 0, 0), A(K::kSendF, 0, 0)},
      {A(K::kRecvF, 0, 1), A(K::kF, 0, 1), A(K::kRecvF, 1, 1), A(K::kF, 1, 1)},
  });
  auto r = Simulate(s, Costs(1, 1));
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find("rank 1 waits on RECV_F1@s1"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("rank 0"), std::string::npos) << msg;
}

TEST(Simulator, RejectsUnloweredAndBadStages) {
  Schedule s = TwoRank();
  s.lowered = false;
  EXPECT_FALSE(Simulate(s, Costs(1, 1)).ok());
  Schedule bad = HandBuilt({{A(K::kF, 0, 3)}});
  EXPECT_FALSE(Simulate(bad, Costs(1, 1)).ok());
  Schedule edge = HandBuilt({{A(K::kRecvF, 0, 0)}});
  EXPECT_FALSE(Simulate(edge, Costs(1, 1)).ok());
}

// A message of a micro-batch the schedule does not have is refused by name (the simulator keeps
// a slot per direction, stage and micro-batch); a repeated send queues behind the first.
TEST(Simulator, MicroBatchesOutsideTheSpecAreRefusedAndRepeatsQueue) {
  Schedule s = HandBuilt({
      {A(K::kF, 0, 0), A(K::kSendF, 2, 0)},
      {A(K::kRecvF, 2, 1), A(K::kF, 0, 1)},
  });
  auto r = Simulate(s, Costs(1, 1));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("SEND_F2@s0 names a micro-batch outside [0, 2)"),
            std::string::npos)
      << r.status();
  Schedule twice = HandBuilt({
      {A(K::kF, 0, 0), A(K::kSendF, 0, 0), A(K::kF, 0, 0), A(K::kSendF, 0, 0)},
      {A(K::kRecvF, 0, 1), A(K::kF, 0, 1), A(K::kRecvF, 0, 1), A(K::kF, 0, 1)},
  });
  SimCosts c = Costs(1, 1);
  c.comm_latency = 0.5;
  auto q = Simulate(twice, c);
  ASSERT_TRUE(q.ok()) << q.status();
  // Rank 1: the first message at 1.5, F until 2.5; the second (sent at 2) at 2.5, F until 3.5.
  EXPECT_DOUBLE_EQ(q->makespan, 3.5);
  // A spec that claims far more micro-batches than the programs hold costs the programs' memory
  // (the slots go sparse), and times them alike.
  Schedule claimed = TwoRank();
  claimed.spec.micro_batches = 1 << 30;
  auto big = Simulate(claimed, c), small = Simulate(TwoRank(), c);
  ASSERT_TRUE(big.ok() && small.ok()) << big.status() << small.status();
  EXPECT_EQ(big->makespan, small->makespan);
}

// Without a timeline, every figure of the result is the same; the timeline is empty.
TEST(Simulator, WithoutATimelineTheFiguresAreTheSame) {
  for (ScheduleKind kind :
       {ScheduleKind::k1F1B, ScheduleKind::kInterleaved, ScheduleKind::kZbH1, ScheduleKind::kZbV}) {
    auto s = GenerateSchedule({kind, 4, 8, kind == ScheduleKind::kInterleaved ? 2 : 1});
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(LowerComm(*s).ok());
    SimCosts c = Costs(1, 1.5, 0.5);
    c.comm_latency = 0.1;
    c.reduce_time = 0.7;
    auto with = Simulate(*s, c), without = Simulate(*s, c, SimOptions{.timeline = false});
    ASSERT_TRUE(with.ok()) << ScheduleKindName(kind) << ": " << with.status();
    ASSERT_TRUE(without.ok()) << without.status();
    EXPECT_EQ(without->makespan, with->makespan);
    EXPECT_EQ(without->bubble_fraction, with->bubble_fraction);
    ASSERT_EQ(without->ranks.size(), with->ranks.size());
    for (size_t r = 0; r < with->ranks.size(); ++r) {
      EXPECT_EQ(without->ranks[r].busy, with->ranks[r].busy);
      EXPECT_EQ(without->ranks[r].peak_inflight, with->ranks[r].peak_inflight);
    }
    EXPECT_FALSE(with->timeline.empty());
    EXPECT_TRUE(without->timeline.empty());
  }
}

TEST(Simulator, PeakInflightCountsHeldActivations) {
  // GPipe-like on one rank: three forwards then three backwards -> 3 held at once.
  Schedule gpipe = HandBuilt({{A(K::kF, 0, 0), A(K::kF, 1, 0), A(K::kF, 2, 0), A(K::kB, 0, 0),
                               A(K::kB, 1, 0), A(K::kB, 2, 0)}});
  auto r = Simulate(gpipe, Costs(1, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->ranks[0].peak_inflight, 3);
  // Alternating F/B: a B that ends when the next F starts frees its slot first.
  Schedule alt = HandBuilt({{A(K::kF, 0, 0), A(K::kB, 0, 0), A(K::kF, 1, 0), A(K::kB, 1, 0)}});
  r = Simulate(alt, Costs(1, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->ranks[0].peak_inflight, 1);
  // Split backward: held until W, not I.
  Schedule split = HandBuilt({{A(K::kF, 0, 0), A(K::kI, 0, 0), A(K::kF, 1, 0), A(K::kW, 0, 0),
                               A(K::kI, 1, 0), A(K::kW, 1, 0)}},
                             /*split=*/true);
  r = Simulate(split, Costs(1, 1, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->ranks[0].peak_inflight, 2);
  EXPECT_DOUBLE_EQ(r->makespan, 6);  // I and W each cost their own share
  // Two chunks on one rank: each F holds half a stage's activations.
  Schedule two_chunks =
      HandBuilt({{A(K::kF, 0, 0), A(K::kF, 0, 1), A(K::kB, 0, 1), A(K::kB, 0, 0)}});
  two_chunks.spec.chunks = 2;
  two_chunks.num_stages = 2;
  two_chunks.stage_rank = {0, 0};
  r = Simulate(two_chunks, Costs(2, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->ranks[0].peak_inflight, 1);
  EXPECT_DOUBLE_EQ(r->makespan, 4);  // each chunk costs 1/v
}

TEST(Export, ChromeTraceStructure) {
  Schedule s = TwoRank();
  auto r = Simulate(s, Costs(1, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string json = ToChromeTrace(s, *r);
  ASSERT_FALSE(json.empty());
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_NE(json.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(json.find("\"displayTimeUnit\": \"ms\""), std::string::npos);
  EXPECT_EQ(Count(json, "\"ph\": \"X\""), static_cast<int>(r->timeline.size()));
  EXPECT_EQ(Count(json, "\"process_name\""), 2);
  EXPECT_NE(json.find("\"name\": \"rank 1\""), std::string::npos);
  // 4 P2P messages: each has an "s" and an "f" with the same id.
  EXPECT_EQ(Count(json, "\"ph\": \"s\""), 4);
  EXPECT_EQ(Count(json, "\"ph\": \"f\""), 4);
  for (int id = 0; id < 4; ++id) {
    const std::string tag = "\"id\": " + std::to_string(id) + ",";
    EXPECT_EQ(Count(json, tag), 2) << tag;
  }
  // B1@s0 runs [7, 9] units = [7000, 9000] us.
  EXPECT_NE(json.find("\"name\": \"B1@s0\", \"cat\": \"B\", \"ph\": \"X\", \"pid\": 0, "
                      "\"tid\": 0, \"ts\": 7000.000, \"dur\": 2000.000"),
            std::string::npos);
  EXPECT_NE(json.find("\"args\": {\"micro_batch\": 1, \"stage\": 0}"), std::string::npos);
}

TEST(Export, SvgStructure) {
  Schedule s = TwoRank();
  auto r = Simulate(s, Costs(1, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string svg = ToSvg(s, *r);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  int compute = 0;
  for (const SimEvent& e : r->timeline) compute += IsCompute(e.action.kind) ? 1 : 0;
  EXPECT_EQ(compute, 8);
  EXPECT_EQ(Count(svg, "<rect class=\"op\""), compute);
  EXPECT_NE(svg.find(">rank 0</text>"), std::string::npos);
  EXPECT_NE(svg.find(">rank 1</text>"), std::string::npos);
  EXPECT_NE(svg.find("makespan 9"), std::string::npos);
  EXPECT_NE(svg.find("bubble 33.3%"), std::string::npos);
  EXPECT_NE(svg.find("class=\"legend\""), std::string::npos);
  EXPECT_EQ(Count(svg, "<svg"), 1);
  EXPECT_EQ(Count(svg, "<text"), Count(svg, "</text>"));
}

// ---- Oracles on generated schedules (GenerateSchedule + LowerComm). ----

absl::StatusOr<SimResult> Generated(ScheduleKind kind, int p, int m, int v, double f, double b,
                                    double w = 0) {
  ScheduleSpec spec;
  spec.kind = kind;
  spec.ranks = p;
  spec.micro_batches = m;
  spec.chunks = v;
  auto s = GenerateSchedule(spec);
  if (!s.ok()) return s.status();
  if (absl::Status st = LowerComm(*s); !st.ok()) return st;
  if (absl::Status st = Validate(*s); !st.ok()) return st;
  return Simulate(*s, Costs(f, b, w));
}

TEST(SimulatorOracle, OneFOneBMakespanBubblePeak) {
  auto r = Generated(ScheduleKind::k1F1B, 4, 8, 1, 1, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->makespan, 33, 1e-9);
  EXPECT_NEAR(r->bubble_fraction, 3.0 / 11.0, 1e-9);
  ASSERT_EQ(r->ranks.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(r->ranks[i].peak_inflight, 4 - i) << i;
}

TEST(SimulatorOracle, GpipeAnd1F1BBubbleClosedForm) {
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B}) {
    for (auto [p, m] : std::vector<std::pair<int, int>>{
             {1, 1}, {2, 1}, {2, 4}, {4, 4}, {4, 8}, {3, 7}, {8, 16}, {4, 2}}) {
      auto r = Generated(kind, p, m, 1, 1, 2);
      ASSERT_TRUE(r.ok()) << ScheduleKindName(kind) << " p=" << p << " m=" << m << ": "
                          << r.status();
      EXPECT_NEAR(r->bubble_fraction, double(p - 1) / (m + p - 1), 1e-9)
          << ScheduleKindName(kind) << " p=" << p << " m=" << m;
      EXPECT_NEAR(r->makespan, 3.0 * (m + p - 1), 1e-9)
          << ScheduleKindName(kind) << " p=" << p << " m=" << m;
    }
  }
}

TEST(SimulatorOracle, GpipeHoldsEveryMicroBatch) {
  auto r = Generated(ScheduleKind::kGpipe, 4, 8, 1, 1, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const SimRank& rk : r->ranks) EXPECT_DOUBLE_EQ(rk.peak_inflight, 8);
}

TEST(SimulatorOracle, InterleavedBubbleAndPeak) {
  const int p = 4, m = 8, v = 2;
  auto r = Generated(ScheduleKind::kInterleaved, p, m, v, 1, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->bubble_fraction, 3.0 / 19.0, 1e-9);
  EXPECT_NEAR(r->ranks[0].peak_inflight, p + double(p - 1) / v, 1e-9);
}

TEST(SimulatorOracle, ZbH1Makespan) {
  for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 2}, {2, 4}, {4, 4}, {4, 8}, {3, 6}}) {
    auto r = Generated(ScheduleKind::kZbH1, p, m, 1, 1, 1, 1);
    ASSERT_TRUE(r.ok()) << "p=" << p << " m=" << m << ": " << r.status();
    EXPECT_NEAR(r->makespan, m * 3.0 + (p - 1) * (1 + 1 - 1), 1e-9) << "p=" << p << " m=" << m;
  }
}

TEST(SimulatorOracle, ZbVRunsAndBeatsOneFOneB) {
  auto zbv = Generated(ScheduleKind::kZbV, 4, 8, 2, 1, 1, 1);
  ASSERT_TRUE(zbv.ok()) << zbv.status();
  auto base = Generated(ScheduleKind::k1F1B, 4, 8, 1, 1, 1, 1);
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_LT(zbv->bubble_fraction, base->bubble_fraction);
}

}  // namespace
}  // namespace pipewright

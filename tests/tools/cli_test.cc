// End-to-end tests of the `pipewright` binary: exit codes, JSON output, checkpoints, resume.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "pipewright/device.h"
#include "tests/tools/cli_util.h"

namespace {

using namespace pipewright::cli_test;

TEST(Cli, NoSubcommandIsUsageError) {
  Result r = RunCli("");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(r.err.empty());
}

TEST(Cli, UnknownFlagIsUsageError) {
  Result r = RunCli("train --no-such-flag");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no-such-flag"), std::string::npos) << r.err;
}

TEST(Cli, BadValuesAreUsageErrors) {
  for (const char* args :
       {"train --steps abc", "train --micro-batches 0", "train --lr -1", "train --preset nope",
        "train --recompute partial", "train --precision fp8", "train --lr-scaling cubic",
        "train --optimizer lion", "train --device tpu", "train --data /no/such/file --steps 1",
        "train --schedule nope", "eval --checkpoint /no/such/dir", "eval", "bench --suite nope"}) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
}

// The runtime issue's acceptance check: every schedule and depth gives the single-stage losses.
TEST(CliPipeline, SameLossesForEveryScheduleAndDepth) {
  const std::string base =
      "train --preset gpt-tiny --steps 4 --seed 7 --micro-batch-size 2 --json ";
  Result ref = RunCli(base + "--pp 1 --dp 1 --micro-batches 8");
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  std::vector<double> want = Losses(ref);
  ASSERT_EQ(want.size(), 4u);
  for (const char* args :
       {"--pp 4 --schedule 1f1b --micro-batches 8", "--pp 2 --schedule gpipe --micro-batches 8",
        "--pp 4 --schedule 1f1b --recompute full --micro-batches 8",
        "--pp 2 --schedule interleaved --chunks 2 --micro-batches 8",
        "--pp 2 --schedule zb-h1 --micro-batches 8", "--pp 2 --schedule zb-v --micro-batches 8",
        "--pp 4 --schedule dualpipev --micro-batches 8"}) {
    Result r = RunCli(base + args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    EXPECT_EQ(Losses(r), want) << args;
  }
  Result dp = RunCli(base + "--pp 2 --dp 2 --micro-batches 4");
  ASSERT_EQ(dp.exit_code, 0) << dp.err;
  std::vector<double> got = Losses(dp);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(std::abs(got[i] - want[i]) / want[i], 1e-5) << "step " << i;
  }
}

// `train --program` runs a hand-written schedule: 1F1B written out by hand gives the generated
// 1F1B's losses, bit for bit; with dp = 2 too.
TEST(CliPipeline, HandWrittenProgramMatchesTheGeneratedSchedule) {
  const std::string program = TempPath("one_f_one_b.txt");
  std::ofstream(program) << "# 1F1B by hand: 2 ranks, 4 micro-batches\n"
                            "rank 0: F0@s0 F1@s0 B0@s0 F2@s0 B1@s0 F3@s0 B2@s0 B3@s0\n"
                            "rank 1: F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1\n";
  const std::string base =
      "train --preset gpt-tiny --steps 3 --seed 7 --micro-batch-size 2 --json ";
  for (const char* dp : {"--dp 1", "--dp 2"}) {
    Result gen = RunCli(base + dp + " --pp 2 --schedule 1f1b --micro-batches 4");
    Result hand = RunCli(base + dp + " --program " + program);
    ASSERT_EQ(gen.exit_code, 0) << gen.err;
    ASSERT_EQ(hand.exit_code, 0) << hand.err;
    ASSERT_EQ(Losses(hand).size(), 3u);
    EXPECT_EQ(Losses(hand), Losses(gen)) << dp;
    EXPECT_EQ(JsonLines(hand.out).back()["summary"]["schedule"], "custom");
  }
  // The program fixes the ranks and the micro-batches.
  Result clash = RunCli(base + "--program " + program + " --pp 2");
  EXPECT_EQ(clash.exit_code, 2);
  EXPECT_NE(clash.err.find("--pp conflicts with --program"), std::string::npos) << clash.err;
  // A program that cannot run is refused before anything runs, naming the file.
  const std::string stuck = TempPath("deadlock.txt");
  std::ofstream(stuck) << "rank 0: B0@s0 F0@s0\nrank 1: F0@s1 B0@s1\n";
  Result bad = RunCli(base + "--program " + stuck);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find(stuck), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("invalid schedule"), std::string::npos) << bad.err;
}

TEST(CliPipeline, SummaryTraceAndTimeline) {
  std::string trace = TempPath("pipe_trace.json"), svg = TempPath("pipe_timeline.svg");
  Result r = RunCli(
      "train --preset gpt-tiny --pp 4 --dp 2 --schedule 1f1b --micro-batches 4 "
      "--steps 2 --json --trace " +
      trace + " --svg " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = JsonLines(r.out);
  ASSERT_FALSE(lines.empty());
  const auto& s = lines.back()["summary"];
  EXPECT_EQ(s["pipeline_parallel"], 4);
  EXPECT_EQ(s["data_parallel"], 2);
  ASSERT_EQ(s["ranks"].size(), 8u);
  for (const auto& rank : s["ranks"]) {
    EXPECT_GT(rank["compute_s"].get<double>(), 0);
    EXPECT_GT(rank["peak_memory_bytes"].get<int64_t>(), 0);
  }
  // The bottleneck is the rank that computes most.
  int busiest = -1;
  double most = -1;
  for (const auto& rank : s["ranks"]) {
    const double c = rank["compute_s"].get<double>() + rank["recompute_s"].get<double>();
    if (c > most) {
      most = c;
      busiest = rank["rank"].get<int>();
    }
  }
  EXPECT_EQ(s["bottleneck_rank"].get<int>(), busiest);
  EXPECT_GT(s["predicted_step_s"].get<double>(), 0);
  std::ifstream t(trace);
  auto tj = nlohmann::json::parse(t, nullptr, false);
  ASSERT_FALSE(tj.is_discarded());
  EXPECT_GT(tj["traceEvents"].size(), 50u);
  // The measured timeline: a labelled row per (stage, replica) rank, times in milliseconds.
  std::ifstream v(svg);
  std::string text((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
  for (int g = 0; g < 8; ++g) {
    const std::string label = "rank " + std::to_string(g) + " (pp " + std::to_string(g % 4) +
                              ", dp " + std::to_string(g / 4) + ")";
    EXPECT_NE(text.find(">" + label + "</text>"), std::string::npos) << label;
  }
  EXPECT_NE(text.find("measured step 2: 1f1b"), std::string::npos);
  EXPECT_NE(text.find(" ms  bubble"), std::string::npos);
  EXPECT_NE(text.find(">ms</text>"), std::string::npos);  // the axis unit
  // dp = 2: the gradient reduction waits and the step agreement are separate columns.
  for (const auto& rank : s["ranks"]) {
    EXPECT_GT(rank["all_reduce_s"].get<double>(), 0);
    EXPECT_GT(rank["agreement_s"].get<double>(), 0);
    // The bucket spans below count in no column: the columns and idle still make the wall.
    double sum = rank["idle_s"].get<double>();
    for (const char* k : {"compute_s", "recompute_s", "p2p_wait_s", "all_reduce_s", "agreement_s",
                          "optimizer_s", "data_wait_s"}) {
      sum += rank[k].get<double>();
    }
    EXPECT_NEAR(sum, rank["wall_s"].get<double>(), 1e-9) << rank.dump();
  }
  // Every rank's gradient buckets, per step: one span each (indices 0..n-1), on its replica's
  // bucket track, the first posted before the rank's last backward of the step ended.
  std::map<std::pair<int, int>, std::string> threads;  // (pid, tid) -> name
  for (const auto& ev : tj["traceEvents"]) {
    if (ev["ph"] == "M" && ev["name"] == "thread_name") {
      threads[{ev["pid"].get<int>(), ev["tid"].get<int>()}] = ev["args"]["name"].get<std::string>();
    }
  }
  std::map<std::pair<int, int64_t>, std::map<int64_t, int>> spans;  // (rank, step) -> bucket
  std::map<std::pair<int, int64_t>, double> first_post, last_backward_end;
  for (const auto& ev : tj["traceEvents"]) {
    if (ev["ph"] != "X") continue;
    const std::pair<int, int64_t> key{ev["args"]["global_rank"].get<int>(),
                                      ev["args"]["step"].get<int64_t>()};
    const double ts = ev["ts"].get<double>(), end = ts + ev["dur"].get<double>();
    if (ev["cat"] == "compute" && ev["name"].get<std::string>()[0] == 'B') {
      last_backward_end[key] = std::max(last_backward_end[key], end);
    }
    if (ev["cat"] != "bucket") continue;
    const std::string track = threads[{ev["pid"].get<int>(), ev["tid"].get<int>()}];
    EXPECT_EQ(track.rfind("replica " + std::to_string(key.first / 4) + ": gradient buckets", 0), 0u)
        << track;
    ++spans[key][ev["args"]["bucket"].get<int64_t>()];
    auto [it, fresh] = first_post.emplace(key, ts);
    if (!fresh) it->second = std::min(it->second, ts);
  }
  ASSERT_EQ(spans.size(), 8u * 2u);  // every rank, both steps
  for (const auto& [key, buckets] : spans) {
    int64_t next = 0;
    for (const auto& [b, n] : buckets) {
      EXPECT_EQ(b, next++) << "rank " << key.first;
      EXPECT_EQ(n, 1) << "rank " << key.first << " step " << key.second << " bucket " << b;
    }
    EXPECT_LT(first_post[key], last_backward_end[key]) << "rank " << key.first;
  }
  // dp = 1: no bucket spans, no bucket track.
  Result one = RunCli("train --preset gpt-tiny --pp 2 --micro-batches 2 --steps 1 --trace " +
                      TempPath("pipe_trace_dp1.json"));
  ASSERT_EQ(one.exit_code, 0) << one.err;
  std::ifstream t1(TempPath("pipe_trace_dp1.json"));
  const std::string dp1((std::istreambuf_iterator<char>(t1)), std::istreambuf_iterator<char>());
  EXPECT_NE(dp1.find("replica 0"), std::string::npos);
  EXPECT_EQ(dp1.find("gradient buckets"), std::string::npos);
  EXPECT_EQ(dp1.find("\"cat\":\"bucket\""), std::string::npos);
  // A human run prints the per-rank table.
  Result h = RunCli("train --preset gpt-tiny --pp 2 --micro-batches 2 --steps 1");
  ASSERT_EQ(h.exit_code, 0) << h.err;
  EXPECT_NE(h.out.find("bottleneck"), std::string::npos) << h.out;
}

// --threads-per-rank: shown in the summary (text and JSON, per rank too); the losses do not
// depend on it (docs/runtime.md, "Threads per rank").
TEST(CliThreads, ThreadsPerRankIsReportedAndChangesNoLoss) {
  const std::string base = "train --preset gpt-tiny --steps 2 --seed 3 --micro-batches 2 ";
  Result one = RunCli(base + "--threads-per-rank 1 --json");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  for (const char* args : {"--threads-per-rank 2", "--threads-per-rank 3 --pp 2", ""}) {
    Result r = RunCli(base + args + " --json");
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    EXPECT_EQ(Losses(r), Losses(one)) << args;
  }
  Result two = RunCli(base + "--threads-per-rank 3 --pp 2 --json");
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const auto lines = JsonLines(two.out);
  ASSERT_FALSE(lines.empty());
  const auto& s = lines.back()["summary"];
  EXPECT_EQ(s["threads_per_rank"], 3);
  ASSERT_EQ(s["ranks"].size(), 2u);
  for (const auto& rank : s["ranks"]) EXPECT_EQ(rank["threads"], 3);
  Result text = RunCli(base + "--threads-per-rank 2");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("2 threads per rank"), std::string::npos) << text.out;
  for (const char* bad : {"--threads-per-rank -1", "--threads-per-rank 256"}) {
    Result r = RunCli(base + bad);
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_NE(r.err.find("--threads-per-rank"), std::string::npos) << r.err;
  }
}

TEST(CliPipeline, ImpossibleSplitsAreUsageErrors) {
  Result r = RunCli("train --preset gpt-tiny --pp 16 --steps 1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("non-empty stages"), std::string::npos) << r.err;
  r = RunCli(
      "train --preset gpt-tiny --pp 2 --schedule interleaved --chunks 2 "
      "--micro-batches 3 --steps 1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("multiple of pipeline ranks"), std::string::npos) << r.err;
  r = RunCli("train --preset gpt-tiny --pp 2 --timeout 0 --steps 1");
  EXPECT_EQ(r.exit_code, 2);
}

TEST(Cli, CudaWithoutGpuIsClearError) {
  if (pipewright::CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  Result r = RunCli("train --device cuda --steps 1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("cuda"), std::string::npos) << r.err;
}

TEST(Cli, TrainJsonLossFallsAndSaves) {
  std::string dir = TempPath("ckpt_main");
  std::filesystem::remove_all(dir);
  Result r = RunCli("train --preset gpt-tiny --pp 1 --dp 1 --steps 60 --json --save " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = JsonLines(r.out);
  std::vector<double> losses = Losses(lines);
  ASSERT_EQ(losses.size(), 60u);
  for (int i = 0; i < 60; ++i) {
    EXPECT_EQ(lines[i]["step"].get<int>(), i);
    for (const char* key : {"loss", "lr", "step_time_s", "samples_per_s"}) {
      EXPECT_TRUE(lines[i].contains(key)) << key;
    }
  }
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += losses[i] / 5, last += losses[55 + i] / 5;
  EXPECT_LT(last, 0.8 * first);
  ASSERT_TRUE(lines.back().contains("summary"));
  // --save DIR is a checkpoint directory: DIR/step-000060 and DIR/latest naming it.
  std::string latest;
  std::getline(std::ifstream(dir + "/latest"), latest);
  EXPECT_EQ(latest, "step-000060");
  const std::string ck = dir + "/" + latest;
  EXPECT_TRUE(std::filesystem::exists(ck + "/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(ck + "/model.safetensors"));
  auto manifest = nlohmann::json::parse(std::ifstream(ck + "/manifest.json"));
  EXPECT_EQ(manifest["format"], "pipewright.checkpoint/v1");
  EXPECT_EQ(manifest["step"], 60);

  Result e = RunCli("eval --checkpoint " + dir + " --data synthetic --json");
  ASSERT_EQ(e.exit_code, 0) << e.err;
  auto ej = nlohmann::json::parse(e.out);
  EXPECT_LT(ej["loss"].get<double>(), first);
}

TEST(Cli, ResumeIsBitIdentical) {
  std::string dir = TempPath("ckpt_resume");
  std::filesystem::remove_all(dir);
  const std::string common = "train --preset gpt-tiny --micro-batches 2 --seed 3 --steps 8 --json";
  Result full = RunCli(common);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  // Interrupt after 4 steps: a run whose total is 8 but that saves at 4 needs --steps 8 for the
  // same LR schedule, so run 4 steps via a separate invocation that stops early.
  Result part = RunCli(common + " --stop-after 4 --save " + dir);
  ASSERT_EQ(part.exit_code, 0) << part.err;
  Result rest = RunCli(common + " --resume " + dir);
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  std::vector<double> a = Losses(JsonLines(full.out));
  std::vector<double> b = Losses(JsonLines(part.out));
  std::vector<double> c = Losses(JsonLines(rest.out));
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(c.size(), 4u);
  b.insert(b.end(), c.begin(), c.end());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a[i], b[i]) << "step " << i;  // bit-identical
}

TEST(Cli, ResumeFromBadCheckpointFails) {
  std::string dir = TempPath("ckpt_bad");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Result r = RunCli("train --steps 2 --resume " + dir);  // no manifest at all
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("manifest"), std::string::npos) << r.err;

  // A damaged manifest (its SHA-256 no longer matches) and no other checkpoint: nothing usable.
  ASSERT_EQ(RunCli("train --steps 1 --save " + dir).exit_code, 0);
  std::ofstream(dir + "/step-000001/manifest.json") << "{not json";
  r = RunCli("train --steps 2 --resume " + dir);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("step-000001/manifest.json: SHA-256 mismatch"), std::string::npos) << r.err;

  // A checkpoint of another model is refused by fingerprint.
  const std::string mlp = TempPath("bad_ckpt_mlp");
  std::filesystem::remove_all(mlp);
  ASSERT_EQ(RunCli("train --preset mlp --steps 1 --save " + mlp).exit_code, 0);
  r = RunCli("train --preset gpt-tiny --steps 2 --resume " + mlp);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("fingerprint"), std::string::npos) << r.err;
}

TEST(Cli, TrainsOnTextFile) {
  std::string path = TempPath("text.txt");
  {
    std::ofstream f(path);
    for (int i = 0; i < 200; ++i) f << "to be or not to be, that is the question. ";
  }
  Result r = RunCli("train --preset mlp --steps 5 --json --data " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Losses(JsonLines(r.out)).size(), 5u);
}

// `data prepare` writes a token file whose samples are the text's, so training on either gives
// the same losses; so does any --data-workers, and a pp=2 run whose middle ranks load nothing.
TEST(Cli, PreparedTokenFileTrainsLikeItsText) {
  const std::string text = TempPath("prep.txt"), tokens = TempPath("prep.tokens");
  {
    std::ofstream f(text);
    for (int i = 0; i < 300; ++i)
      f << "Friends, Romans, countrymen, lend me your ears " << i << ". ";
  }
  Result p = RunCli("data prepare --input " + text + " --output " + tokens + " --json");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  auto info = nlohmann::json::parse(p.out);
  EXPECT_EQ(info["dtype"], "uint16");
  EXPECT_EQ(info["vocab_size"], 256);
  EXPECT_EQ(info["tokens"].get<int64_t>(), static_cast<int64_t>(std::filesystem::file_size(text)));
  const std::string base =
      "train --preset gpt-tiny --steps 3 --seed 4 --micro-batch-size 2 --json ";
  Result ref = RunCli(base + "--data " + text);
  ASSERT_EQ(ref.exit_code, 0) << ref.err;
  std::vector<double> want = Losses(ref);
  ASSERT_EQ(want.size(), 3u);
  for (const std::string& args :
       {"--data " + tokens, "--data " + tokens + " --data-workers 0",
        "--data " + tokens + " --data-workers 3", "--data " + text + " --data-workers 2 --pp 4"}) {
    Result r = RunCli(base + args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    EXPECT_EQ(Losses(r), want) << args;
  }
  Result e = RunCli("eval --checkpoint /no/such/dir --data " + tokens);
  EXPECT_EQ(e.exit_code, 2);
}

TEST(Cli, BadDataIsAUsageError) {
  const std::string bad = TempPath("bad.tokens");
  std::ofstream(bad) << "PWTOKENS\n{\"format\": 3}" << std::string(300, ' ');
  for (const std::string& args : {std::string("train --steps 1 --data ") + bad,
                                  std::string("data prepare --input /no/such "
                                              "--output ") +
                                      TempPath("o.tokens"),
                                  std::string("data prepare --input x"), std::string("data"),
                                  std::string("train --steps 1 --data-workers -1"),
                                  std::string("train --lr-scaling cubic")}) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
  Result r = RunCli(std::string("train --steps 1 --data ") + bad);
  EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
}

TEST(Cli, SqrtLrScaling) {
  // Global batch 4 x 8 = 32 against --base-batch 8: sqrt scales the peak lr by 2.
  const std::string base =
      "train --preset gpt-tiny --steps 2 --warmup 0 --micro-batches 4 --micro-batch-size 8 "
      "--base-batch 8 --lr 0.001 --json --lr-scaling ";
  Result r = RunCli(base + "sqrt");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = JsonLines(r.out);
  ASSERT_GE(lines.size(), 1u);
  EXPECT_NEAR(lines[0]["lr"].get<double>(), 0.002, 1e-6);
  r = RunCli(base + "linear");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NEAR(JsonLines(r.out)[0]["lr"].get<double>(), 0.004, 1e-6);
}

}  // namespace

namespace {

TEST(CliSimulate, OneFOneBMatchesPaper) {
  Result r = RunCli(
      "simulate --schedule 1f1b --stages 4 --micro-batches 8 --cost-f 1 --cost-b 2 "
      "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_DOUBLE_EQ(j["makespan"].get<double>(), 33.0);
  EXPECT_NEAR(j["bubble_fraction"].get<double>(), 3.0 / 11.0, 1e-12);
  ASSERT_EQ(j["ranks"].size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(j["ranks"][i]["peak_inflight"].get<double>(), 4 - i);
}

TEST(CliSimulate, InterleavedAndZbH1) {
  Result r = RunCli(
      "simulate --schedule interleaved --chunks 2 --stages 4 --micro-batches 8 "
      "--cost-f 1 --cost-b 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NEAR(nlohmann::json::parse(r.out)["bubble_fraction"].get<double>(), 3.0 / 19.0, 1e-12);
  r = RunCli(
      "simulate --schedule zb-h1 --stages 4 --micro-batches 8 --cost-f 1 --cost-b 1 "
      "--cost-w 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(r.out)["makespan"].get<double>(), 27.0);
}

// A dp = 1 run without ties across ranks reduces no gradients: its all-reduce time is zero and
// the step agreement (which every run has) is its own column, in the table and in --json.
TEST(CliPipeline, AOneReplicaRunHasNoAllReduceTimeOnlyTheAgreement) {
  Result r = RunCli("train --preset gpt-tiny --pp 2 --micro-batches 2 --steps 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = JsonLines(r.out);
  ASSERT_FALSE(lines.empty());
  const auto& s = lines.back()["summary"];
  ASSERT_EQ(s["ranks"].size(), 2u);
  for (const auto& rank : s["ranks"]) {
    EXPECT_EQ(rank["all_reduce_s"].get<double>(), 0) << rank;
    EXPECT_GT(rank["agreement_s"].get<double>(), 0) << rank;
  }
  Result text = RunCli("train --preset gpt-tiny --pp 2 --micro-batches 2 --steps 2");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("all-reduce  agreement"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("ms on the step agreement"), std::string::npos) << text.out;
}

TEST(CliSimulate, WritesTraceAndSvg) {
  std::string trace = TempPath("sim_trace.json"), svg = TempPath("sim.svg");
  Result r = RunCli("simulate --schedule zb-v --stages 4 --micro-batches 8 --trace " + trace +
                    " --svg " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto t = nlohmann::json::parse(std::ifstream(trace));
  EXPECT_GT(t["traceEvents"].size(), 0u);
  std::ifstream s(svg);
  std::string text((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
}

TEST(CliSimulate, BadArgumentsExit2) {
  for (const char* args :
       {"simulate --schedule nope --stages 4 --micro-batches 8",
        "simulate --schedule 1f1b --stages 0 --micro-batches 8",
        "simulate --schedule 1f1b --stages 4 --micro-batches 0",
        "simulate --schedule interleaved --chunks 2 --stages 4 --micro-batches 6",
        "simulate --schedule 1f1b --stages 4 --micro-batches 8 --cost-f -1",
        "simulate --schedule custom --stages 2 --micro-batches 1 --program /no/such/file"}) {
    Result r = RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_FALSE(r.err.empty()) << args;
  }
}

TEST(CliSimulate, HandWrittenDeadlockNamesRanks) {
  std::string path = TempPath("deadlock.txt");
  std::ofstream(path) << "rank 0: RECV_B0@s0 F0@s0 SEND_F0@s0 B0@s0\n"
                         "rank 1: RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n";
  Result r = RunCli("simulate --schedule custom --stages 2 --micro-batches 1 --program " + path);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.err.find("rank 0 waits on RECV_B0@s0"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 waits on RECV_F0@s1"), std::string::npos) << r.err;
}

}  // namespace

// --- Per-step output (issue 36, item 2) ----------------------------------------------------------

// The lines of `text` that start with "step ".
std::vector<std::string> StepLines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    if (line.rfind("step ", 0) == 0) out.push_back(line);
    start = end + 1;
  }
  return out;
}

const std::string kTinyRun = "train --preset gpt-tiny --micro-batches 2 --micro-batch-size 2 ";

TEST(CliLog, IntoAPipeEveryTenthStepIsAPlainLine) {
  Result r = RunCli(kTinyRun + "--steps 23");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> lines = StepLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;  // the first, 10, 20 and the last
  EXPECT_EQ(lines[0].rfind("step 1/23  loss ", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("step 10/23  loss ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 20/23  loss ", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("step 23/23  loss ", 0), 0u) << lines[3];
  EXPECT_NE(lines[1].find(" elapsed, eta "), std::string::npos) << lines[1];
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << "no control codes into a pipe";
  EXPECT_EQ(r.out.find('\033'), std::string::npos) << "no control codes into a pipe";
}

TEST(CliLog, LogEverySetsTheInterval) {
  Result r = RunCli(kTinyRun + "--steps 7 --log-every 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> lines = StepLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;  // 1, 3, 6, 7
  EXPECT_EQ(lines[1].rfind("step 3/7 ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 6/7 ", 0), 0u) << lines[2];
  // A resumed run counts from where it starts.
  const std::string dir = TempPath("log_every_ckpt");
  ASSERT_EQ(RunCli(kTinyRun + "--steps 4 --save " + dir).exit_code, 0);
  r = RunCli(kTinyRun + "--steps 9 --log-every 5 --resume " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> resumed = StepLines(r.out);
  ASSERT_EQ(resumed.size(), 2u) << r.out;  // 5 (its first, and the interval's), then 9
  EXPECT_EQ(resumed[0].rfind("step 5/9 ", 0), 0u) << resumed[0];
  EXPECT_EQ(resumed[1].rfind("step 9/9 ", 0), 0u) << resumed[1];
}

TEST(CliLog, OnATerminalABarWithAnEtaUnlessALauncherForwardsTheOutput) {
  if (std::system("command -v script >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no 'script' to give the CLI a terminal";
  }
  const std::string run = Bin() + " " + kTinyRun + "--steps 3";
  // script(1) runs the CLI on a pseudo-terminal and copies what it drew to our pipe.
  Result r = RunCliWith("script -qec '" + run + "' /dev/null", "");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("\r[##########....................] 1/3 loss "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3/3 loss "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" elapsed, eta "), std::string::npos) << r.out;
  // Under a launcher (Slurm's environment here) the same terminal gets plain lines.
  r = RunCliWith("SLURM_PROCID=0 script -qec '" + run + "' /dev/null", "");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(r.out.find('\033'), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 3/3  loss "), std::string::npos) << r.out;
}

// --- Text generation (issue 36, item 1) ----------------------------------------------------------

TEST(CliGenerate, ATrainedCheckpointContinuesThePromptReproduciblyFromTheSeed) {
  const std::string dir = TempPath("generate_ckpt");
  ASSERT_EQ(RunCli(kTinyRun + "--steps 3 --save " + dir).exit_code, 0);
  const std::string gen = "generate --checkpoint " + dir + " --prompt 'ROMEO:' --tokens 24 ";
  Result a = RunCli(gen + "--seed 3");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  // Streamed: the prompt, 24 generated bytes, a newline; the rate and checkpoint on stderr.
  EXPECT_EQ(a.out.rfind("ROMEO:", 0), 0u) << a.out;
  EXPECT_EQ(a.out.size(), 6u + 24u + 1u) << a.out;
  EXPECT_NE(a.err.find("generated 24 tokens in "), std::string::npos) << a.err;
  EXPECT_NE(a.err.find("by gpt-tiny at step 3 (" + dir + "/step-000003)"), std::string::npos)
      << a.err;
  EXPECT_EQ(RunCli(gen + "--seed 3").out, a.out) << "the same seed gives the same text";
  bool differs = false;
  for (int seed : {4, 5, 6})
    differs = differs || RunCli(gen + "--seed " + std::to_string(seed)).out != a.out;
  EXPECT_TRUE(differs) << "other seeds never changed the text";
  // Greedy decoding ignores the seed; --json reports instead of streaming.
  Result g1 = RunCli(gen + "--temperature 0 --seed 1 --json");
  Result g2 = RunCli(gen + "--temperature 0 --seed 2 --json");
  ASSERT_EQ(g1.exit_code, 0) << g1.err;
  nlohmann::json j1 = nlohmann::json::parse(g1.out), j2 = nlohmann::json::parse(g2.out);
  EXPECT_EQ(j1["text"], j2["text"]);
  EXPECT_EQ(j1["tokens"], 24);
  EXPECT_EQ(j1["step"], 3);
  EXPECT_EQ(j1["prompt"], "ROMEO:");
  EXPECT_EQ(j1["model"], "gpt-tiny");
}

TEST(CliGenerate, TheKvCacheGivesTheRecomputedGreedyTextWithinTheWindow) {
  const std::string dir = TempPath("generate_kv_ckpt");
  ASSERT_EQ(RunCli(kTinyRun + "--steps 3 --save " + dir).exit_code, 0);
  // gpt-tiny's window is 32 tokens: the prompt's 6 and 26 generated fill it.
  const std::string gen =
      "generate --checkpoint " + dir + " --prompt 'ROMEO:' --tokens 26 --temperature 0 --json";
  Result cached = RunCli(gen), full = RunCli(gen + " --no-kv-cache");
  ASSERT_EQ(cached.exit_code, 0) << cached.err;
  ASSERT_EQ(full.exit_code, 0) << full.err;
  nlohmann::json c = nlohmann::json::parse(cached.out), f = nlohmann::json::parse(full.out);
  EXPECT_EQ(c["kv_cache"], true);
  EXPECT_EQ(f["kv_cache"], false);
  EXPECT_EQ(c["text"], f["text"]);
  // Past the window the cached path refills it (Note [Sampling]) and keeps going.
  Result longer = RunCli("generate --checkpoint " + dir + " --tokens 100 --json");
  ASSERT_EQ(longer.exit_code, 0) << longer.err;
  EXPECT_EQ(nlohmann::json::parse(longer.out)["tokens"], 100);
}

TEST(CliGenerate, BadInputIsAUsageErrorNamingIt) {
  Result r = RunCli("generate --checkpoint " + TempPath("no_such_generate_ckpt"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("no_such_generate_ckpt"), std::string::npos) << r.err;
  r = RunCli("generate --checkpoint x --temperature nan");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--temperature"), std::string::npos) << r.err;
}

// generate --device: the CPU's greedy text on a GPU (the logits agree to fp32 rounding); without
// a GPU, an error naming the flag. A device that is neither is a usage error.
TEST(CliGenerate, OnAGpuTheGreedyTextIsTheCpusAndWithoutOneAnError) {
  const std::string dir = TempPath("generate_device_ckpt");
  ASSERT_EQ(RunCli(kTinyRun + "--steps 3 --save " + dir).exit_code, 0);
  const std::string gen =
      "generate --checkpoint " + dir + " --prompt 'ROMEO:' --tokens 40 --temperature 0 --json";
  Result bad = RunCli(gen + " --device tpu");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--device"), std::string::npos) << bad.err;
  Result cpu = RunCli(gen);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_EQ(nlohmann::json::parse(cpu.out)["device"], "cpu");
  Result gpu = RunCli(gen + " --device cuda");
  if (pipewright::CudaDeviceCount() == 0) {
    EXPECT_NE(gpu.exit_code, 0);
    EXPECT_NE(gpu.err.find("--device"), std::string::npos) << gpu.err;
    EXPECT_NE(gpu.err.find("usable GPU"), std::string::npos) << gpu.err;
    return;
  }
  ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
  nlohmann::json g = nlohmann::json::parse(gpu.out), c = nlohmann::json::parse(cpu.out);
  EXPECT_EQ(g["device"], "cuda:0");
  EXPECT_EQ(g["kv_cache"], true);
  EXPECT_EQ(g["text"], c["text"]);
  Result full = RunCli(gen + " --device cuda --no-kv-cache");
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_EQ(nlohmann::json::parse(full.out)["text"], c["text"]);
}

// --- Model specs (issue 38, item 2) --------------------------------------------------------------

// A Llama spec trains (pp 2), checkpoints, evaluates and resumes with no flag naming the model
// again; `model` and `plan` take it, and `train --plan` runs a plan made for it; a bad spec is
// a usage error naming the key.
TEST(CliModelSpec, ALlamaSpecTrainsPlansEvaluatesAndResumes) {
  const std::string spec = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=256";
  const std::string name = spec + ",tied=0,rope_theta=10000";
  const std::string dir = TempPath("cli_spec_ckpt");
  Result r = RunCli("train --model " + spec + " --pp 2 --steps 3 --json --save " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  Result e = RunCli("eval --batches 1 --json --checkpoint " + dir);
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_EQ(nlohmann::json::parse(e.out)["model"], name);
  Result resumed = RunCli("train --resume " + dir + " --steps 4 --save " + dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("model " + name + " from the checkpoint's manifest"),
            std::string::npos)
      << resumed.err;
  EXPECT_NE(resumed.err.find("resumed from "), std::string::npos) << resumed.err;
  const std::string plan = TempPath("cli_spec_plan.json");
  Result p = RunCli("plan --model " + spec + " --devices 2 --device-memory 1GiB -o " + plan);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  Result t = RunCli("train --plan " + plan + " --steps 2 --json");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  Result m = RunCli("model --model " + spec);
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_EQ(nlohmann::json::parse(m.out)["name"], name);
  Result bad = RunCli("train --model llama:layers=2,hidden=32,heads=4,ffn=64,seq=16 --steps 1");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("missing vocab="), std::string::npos) << bad.err;
  Result both = RunCli("train --preset gpt-tiny --model " + spec + " --steps 1");
  EXPECT_EQ(both.exit_code, 2) << both.err;
}

// Tensor and sequence parallelism from the command line for a Llama spec: tp 2 at pp 2 gives
// tp 2 at pp 1's losses bit for bit, with --sequence-parallel too; a plan searched at tp 2
// runs; a tp that does not divide the key-value heads is a usage error naming them.
TEST(CliModelSpec, ALlamaSpecRunsTensorParallel) {
  const std::string run =
      "train --model llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=256 "
      "--micro-batches 2 --steps 2 --json --tp 2 ";
  auto losses = [](const std::string& out) {
    std::vector<double> l;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      if (line.empty()) continue;
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss") && j.contains("step")) l.push_back(j["loss"].get<double>());
    }
    return l;
  };
  for (const std::string sp : {"", "--sequence-parallel "}) {
    Result one = RunCli(run + sp + "--pp 1");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    Result two = RunCli(run + sp + "--pp 2");
    ASSERT_EQ(two.exit_code, 0) << two.err;
    ASSERT_EQ(losses(one.out).size(), 2u) << one.out;
    EXPECT_EQ(losses(one.out), losses(two.out)) << sp;
  }
  const std::string plan = TempPath("cli_llama_tp_plan.json");
  Result p = RunCli(
      "plan --model llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=256 "
      "--devices 2 --tp 2 --device-memory 1GiB -o " +
      plan);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  Result t = RunCli("train --plan " + plan + " --steps 1 --json");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  Result bad = RunCli("train --preset llama-tiny --tp 4 --steps 1");
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("key-value heads"), std::string::npos) << bad.err;
}

// --- The ecosystem's token files (issue 38, item 5) ---------------------------------------------

// An llm.c shard and a Megatron dataset written here train gpt-tiny from --data and evaluate;
// the summary names the format; ids past the byte-level vocabulary are refused naming --data.
TEST(CliData, LlmcShardsAndMegatronDatasetsTrainAndEvaluate) {
  std::string text;
  for (int i = 0; i < 60; ++i) text += "Now is the winter of our discontent made glorious. ";
  auto put32 = [](std::string* s, int32_t v) { s->append(reinterpret_cast<const char*>(&v), 4); };
  std::string shard;
  for (int32_t h : {20240520, 1, static_cast<int32_t>(text.size())}) put32(&shard, h);
  shard.resize(1024, '\0');
  for (unsigned char c : text) shard.append({static_cast<char>(c), '\0'});  // uint16
  const std::string shard_path = TempPath("cli_shard_000001.bin");
  std::ofstream(shard_path, std::ios::binary) << shard;
  // Megatron: uint8 tokens (dtype 1), one sequence.
  const std::string prefix = TempPath("cli_megatron_text_document");
  std::ofstream(prefix + ".bin", std::ios::binary) << text;
  std::string idx("MMIDIDX\0\0", 9);
  auto put64 = [](std::string* s, uint64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); };
  put64(&idx, 1);
  idx.push_back(1);
  put64(&idx, 1);
  put64(&idx, 2);
  put32(&idx, static_cast<int32_t>(text.size()));
  put64(&idx, 0);
  put64(&idx, 0);
  put64(&idx, 1);
  std::ofstream(prefix + ".idx", std::ios::binary) << idx;
  for (const std::string& data : {shard_path, prefix}) {
    const std::string dir = TempPath("cli_formats_ckpt");
    std::filesystem::remove_all(dir);
    Result r = RunCli(kTinyRun + "--steps 2 --json --data " + data + " --save " + dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    // eval finds the training data in the checkpoint: the same --data, read again.
    Result e = RunCli("eval --batches 1 --json --checkpoint " + dir);
    ASSERT_EQ(e.exit_code, 0) << e.err;
    EXPECT_EQ(nlohmann::json::parse(e.out)["data"], data) << e.out;
  }
  // A GPT-2 id in a shard: more than the byte-level model's vocabulary.
  shard[1024 + 2 * 7] = static_cast<char>(0x50);
  shard[1024 + 2 * 7 + 1] = static_cast<char>(0xc4);
  std::ofstream(shard_path, std::ios::binary | std::ios::trunc) << shard;
  Result big = RunCli(kTinyRun + "--steps 1 --data " + shard_path);
  EXPECT_EQ(big.exit_code, 2) << big.err;
  EXPECT_NE(big.err.find("vocabulary 50257"), std::string::npos) << big.err;
}

// --- eval names its data (issue 36, item 3) ------------------------------------------------------

TEST(CliEval, WithoutDataItEvaluatesTheCheckpointsTrainingDataAndSaysSo) {
  const std::string text = TempPath("eval_corpus.txt"), dir = TempPath("eval_default_ckpt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "To be, or not to be: that is the question. " << i << "\n";
  }
  ASSERT_EQ(RunCli(kTinyRun + "--steps 2 --data " + text + " --save " + dir).exit_code, 0);
  Result own = RunCli("eval --batches 2 --json --checkpoint " + dir);
  ASSERT_EQ(own.exit_code, 0) << own.err;
  nlohmann::json j = nlohmann::json::parse(own.out);
  EXPECT_EQ(j["data"], text);
  EXPECT_EQ(j["data_is_the_training_data"], true);
  Result named = RunCli("eval --batches 2 --json --checkpoint " + dir + " --data " + text);
  ASSERT_EQ(named.exit_code, 0) << named.err;
  nlohmann::json n = nlohmann::json::parse(named.out);
  EXPECT_EQ(n["loss"], j["loss"]) << "the default is exactly --data <the training file>";
  EXPECT_EQ(n["data_is_the_training_data"], false);
  Result synthetic = RunCli("eval --batches 2 --json --checkpoint " + dir + " --data synthetic");
  ASSERT_EQ(synthetic.exit_code, 0) << synthetic.err;
  EXPECT_NE(nlohmann::json::parse(synthetic.out)["loss"], j["loss"]);
  // The text line names the data and where it came from.
  Result line = RunCli("eval --batches 1 --checkpoint " + dir);
  EXPECT_NE(line.out.find("tokens of " + text + " (the checkpoint's training data; held-out"),
            std::string::npos)
      << line.out;
  // The training data gone: an error naming it, not a silent switch to synthetic data.
  std::filesystem::remove(text);
  Result gone = RunCli("eval --batches 1 --checkpoint " + dir);
  EXPECT_EQ(gone.exit_code, 2) << gone.err;
  EXPECT_NE(gone.err.find(text), std::string::npos) << gone.err;
}

// --- Hand-written splits (issue 36, item 7) ------------------------------------------------------

TEST(CliSplit, LayersByHandRunWhereTheySayAndLoseNothing) {
  // "layers 0-2 on the first rank, 3-5 on the second, 6-7 on the third".
  Result split = RunCli(kTinyRun + "--steps 3 --pp 3 --split 3,6");
  ASSERT_EQ(split.exit_code, 0) << split.err;
  EXPECT_NE(split.out.find("stages [0,3) [3,6) [6,8)"), std::string::npos) << split.out;
  // Any split gives one stage's losses, bit for bit (the pipeline promise).
  Result one = RunCli(kTinyRun + "--steps 3 --json");
  Result json = RunCli(kTinyRun + "--steps 3 --pp 3 --split 1,7 --json");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(StepLosses(json.out), StepLosses(one.out));
  // Wrong splits name the flag and what is wrong.
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--pp 3 --split 3", "--split 3 makes 2 stages; the schedule has 3"},
           {"--pp 3 --split 6,3", "--split 6,3: 3 must be greater than 6"},
           {"--pp 2 --split 8", "less than the model's 8 layers"},
           {"--pp 2 --split x", "--split x: 'x' is not a layer index"},
       }) {
    Result r = RunCli(kTinyRun + "--steps 1 " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << args << ": " << r.err;
  }
}

// A plan of only stages[].layers runs like --split, is completed with predictions, and every
// mistake in it is named with its place (Note [Minimal plans] in tools/train_model.cc).
TEST(CliSplit, AMinimalPlanOfLayersRunsAndIsCompletedWithPredictions) {
  const std::string plan = TempPath("minimal_plan.json");
  std::ofstream(plan) << R"({"stages": [{"layers": [0, 3]}, {"layers": [3, 6]},
                                       {"layers": [6, 8], "recompute": "full"}]})";
  Result r = RunCli(kTinyRun + "--steps 3 --plan " + plan);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("pp=3 dp=1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stages [0,3) [3,6) [6,8)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan vs run"), std::string::npos) << r.out;  // predictions computed
  EXPECT_NE(r.out.find("full"), std::string::npos) << r.out;
  // The same losses as --split (and so as one stage), bit for bit.
  Result json = RunCli(kTinyRun + "--steps 3 --json --plan " + plan);
  Result split = RunCli(kTinyRun + "--steps 3 --json --pp 3 --split 3,6");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(StepLosses(json.out), StepLosses(split.out));
  // Interleaved: four stages make pp 2 with two chunks.
  const std::string four = TempPath("minimal_plan4.json");
  std::ofstream(four) << R"({"stages": [{"layers": [0, 2]}, {"layers": [2, 4]},
                                       {"layers": [4, 6]}, {"layers": [6, 8]}]})";
  Result inter = RunCli(kTinyRun + "--steps 1 --schedule interleaved --plan " + four);
  ASSERT_EQ(inter.exit_code, 0) << inter.err;
  EXPECT_NE(inter.out.find("pp=2 dp=1 interleaved chunks=2"), std::string::npos) << inter.out;
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"stages": [{"layers": [0, 3]}, {"layers": [4, 8]}]})",
            "stages[1].layers: [4, 8] must start at 3"},
           {R"({"stages": [{"layers": [0, 3]}, {"layers": [3, 7]}]})",
            "the stages end at layer 7; the model (gpt-tiny) has 8"},
           {R"({"stages": [{"layers": [0, 9]}]})", "at most at the model's 8 layers"},
           {R"({"stages": [{"layers": [0, 8], "gpu": 1}]})", "stages[0]: unknown key 'gpu'"},
           {R"({"stages": [{"layers": [0, 8]}], "pp": 1})", "unknown key 'pp'"},
           {R"({"stages": [{"layers": [0, 2147483648]}]})", "at most at the model's 8 layers"},
           {R"({"stages": [{"layers": [0, 8.5]}]})", "expected [begin, end], two integers"},
           {R"({"stages": [{"layers": [0, 8], "recompute": "some"}]})", "stages[0].recompute"},
           {R"({"stages": []})", "stages must be an array of 1 to"},
       }) {
    std::ofstream(plan) << text;
    Result bad = RunCli(kTinyRun + "--steps 1 --plan " + plan);
    EXPECT_EQ(bad.exit_code, 2) << text << ": " << bad.err;
    EXPECT_NE(bad.err.find(message), std::string::npos) << text << ": " << bad.err;
    EXPECT_NE(bad.err.find(plan), std::string::npos) << text << ": " << bad.err;
  }
  std::ofstream(plan) << R"({"stages": [{"layers": [0, 4]}, {"layers": [4, 8]}]})";
  Result clash = RunCli(kTinyRun + "--steps 1 --pp 4 --plan " + plan);
  EXPECT_EQ(clash.exit_code, 2) << clash.err;
  EXPECT_NE(clash.err.find("--pp 4 conflicts with"), std::string::npos) << clash.err;
}

// --- simulate --program takes the program's own shape (issue 36, item 5) ------------------------

TEST(CliSimulate, AProgramNeedsNoStagesOrMicroBatches) {
  const std::string program = TempPath("simulate_program.txt");
  {
    std::ofstream out(program);
    out << "rank 0: F0@s0 F1@s0 B0@s0 B1@s0\nrank 1: F0@s1 B0@s1 F1@s1 B1@s1\n";
  }
  Result r = RunCli("simulate --program " + program + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  // The same figures as when the shape is spelled out.
  Result spelled = RunCli("simulate --program " + program + " --stages 2 --micro-batches 2 --json");
  ASSERT_EQ(spelled.exit_code, 0) << spelled.err;
  EXPECT_EQ(j, nlohmann::json::parse(spelled.out));
  Result half = RunCli("simulate --program " + program + " --stages 2");
  EXPECT_EQ(half.exit_code, 2);
  EXPECT_NE(half.err.find("needs both (or neither"), std::string::npos) << half.err;
  Result none = RunCli("simulate");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("simulate needs --stages and --micro-batches"), std::string::npos)
      << none.err;
}

// --- Metrics file and its plot (issue 36, item 2) ------------------------------------------------

TEST(CliMetrics, ARowPerStepAndAPlotOfThem) {
  const std::string csv = TempPath("metrics.csv"), svg = TempPath("metrics.svg");
  Result r = RunCli(kTinyRun + "--steps 6 --json --metrics " + csv);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string text = ReadAll(csv);
  std::vector<std::string> lines;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  ASSERT_EQ(lines.size(), 7u) << text;
  EXPECT_EQ(lines[0],
            "step,loss,lr,grad_norm,step_time_s,samples_per_s,tokens_per_s,peak_memory_bytes,"
            "loss_scale,skipped,eval_loss,model_tflops_per_s,mfu");
  // The same losses as the JSON lines, to the printed digits.
  const auto steps = StepLosses(r.out);
  ASSERT_EQ(steps.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(lines[i + 1].rfind(std::to_string(i) + ",", 0), 0u) << lines[i + 1];
    const double loss = std::stod(lines[i + 1].substr(lines[i + 1].find(',') + 1));
    EXPECT_EQ(loss, steps[i].second) << lines[i + 1];
    // Model TFLOP/s is there; mfu is empty without --peak-tflops.
    EXPECT_GT(std::stod(lines[i + 1].substr(lines[i + 1].rfind(',', lines[i + 1].size() - 2) + 1)),
              0)
        << lines[i + 1];
    EXPECT_EQ(lines[i + 1].back(), ',') << lines[i + 1];
  }
  // With a device peak: mfu = model TFLOP/s / (pp x dp x peak), and model TFLOP/s = samples/s x
  // the model's FLOPs per sequence (gpt-tiny: the summary's GFLOP/s agree).
  const std::string peak_csv = TempPath("metrics_peak.csv");
  Result pk = RunCli(kTinyRun + "--steps 2 --pp 2 --peak-tflops 0.5 --metrics " + peak_csv);
  ASSERT_EQ(pk.exit_code, 0) << pk.err;
  const std::string peak_text = ReadAll(peak_csv);
  const std::string row = peak_text.substr(peak_text.find('\n') + 1);
  std::vector<double> fields;
  for (size_t at = 0; at < row.size();) {
    size_t end = row.find_first_of(",\n", at);
    fields.push_back(end == at ? NAN : std::stod(row.substr(at, end - at)));
    at = end + 1;
    if (row[end] == '\n') break;
  }
  ASSERT_EQ(fields.size(), 13u) << row;
  EXPECT_NEAR(fields[12], fields[11] / (2 * 0.5), 1e-5 * fields[12]) << row;
  Result p = RunCli("plot " + csv + " -o " + svg);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  const std::string picture = ReadAll(svg);
  EXPECT_EQ(picture.rfind("<svg xmlns='http://www.w3.org/2000/svg'", 0), 0u);
  for (const char* label : {">loss<", ">learning rate<", ">samples/s<", ">step<"}) {
    EXPECT_NE(picture.find(label), std::string::npos) << label;
  }
  EXPECT_EQ(std::count(picture.begin(), picture.end(), '\n') > 20, true);
  // Looked at in a real browser when one is installed: it renders to a PNG without complaint.
  if (std::system("command -v chromium >/dev/null 2>&1") == 0) {
    const std::string png = TempPath("metrics.png");
    const std::string cmd =
        "timeout 120 chromium --headless --no-sandbox --disable-gpu "
        "--screenshot=" +
        png + " --window-size=940,760 file://" + svg + " >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    EXPECT_GT(std::filesystem::file_size(png), 1000u);
  }
  // A file that is not a metrics table is refused by name.
  {
    std::ofstream bad(csv);
    bad << "step,loss\n0,1.5\n1,oops\n";
  }
  Result b = RunCli("plot " + csv + " -o " + svg);
  EXPECT_EQ(b.exit_code, 2);
  EXPECT_NE(b.err.find("line 3, column loss: 'oops' is not a finite number"), std::string::npos)
      << b.err;
}

// --- Held-out loss during training (issue 36, item 3) --------------------------------------------

TEST(CliEvalEvery, TheHeldOutLossDuringTrainingIsEvalsOnTheSavedWeights) {
  const std::string text = TempPath("valid_corpus.txt"), dir = TempPath("valid_ckpt"),
                    csv = TempPath("valid_metrics.csv");
  {
    std::ofstream out(text);
    for (int i = 0; i < 300; ++i) out << "Now is the winter of our discontent " << i << "\n";
  }
  Result r = RunCli(kTinyRun + "--steps 4 --eval-every 2 --eval-batches 2 --valid-data " + text +
                    " --save " + dir + " --metrics " + csv + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> evals;
  for (const nlohmann::json& j : JsonLines(r.out)) {
    if (j.contains("eval")) evals.push_back(j["eval"]);
  }
  ASSERT_EQ(evals.size(), 2u) << r.out;  // after steps 2 and 4
  EXPECT_EQ(evals[0]["step"], 2);
  EXPECT_EQ(evals[1]["step"], 4);
  Result e = RunCli("eval --json --batches 2 --checkpoint " + dir + " --data " + text);
  ASSERT_EQ(e.exit_code, 0) << e.err;
  EXPECT_EQ(evals[1]["loss"].get<double>(), nlohmann::json::parse(e.out)["loss"].get<double>())
      << "the same weights, data, seed and batches give the same bits";
  // The CSV has the eval loss on the evaluated steps only.
  const std::string rows = ReadAll(csv);
  // Row `step`'s field under the header's column `name` ("" for an empty one).
  auto field = [&rows](int step, const std::string& name) {
    auto split = [](const std::string& line) {
      std::vector<std::string> out(1);
      for (char c : line) {
        if (c == ',') {
          out.emplace_back();
        } else {
          out.back().push_back(c);
        }
      }
      return out;
    };
    const std::vector<std::string> header = split(rows.substr(0, rows.find('\n')));
    const size_t at = rows.find("\n" + std::to_string(step) + ",");
    if (at == std::string::npos) return std::string("<no row>");
    const std::vector<std::string> row =
        split(rows.substr(at + 1, rows.find('\n', at + 1) - at - 1));
    for (size_t i = 0; i < header.size() && i < row.size(); ++i) {
      if (header[i] == name) return row[i];
    }
    return std::string("<no column>");
  };
  EXPECT_EQ(field(0, "eval_loss"), "") << rows;
  EXPECT_NE(field(1, "eval_loss"), "") << "step 1 (the second) was evaluated: " << rows;
  EXPECT_NE(field(1, "eval_loss").front(), '<') << rows;
  EXPECT_EQ(field(2, "eval_loss"), "") << "step 2 (the third) was not: " << rows;
}

// --- simulate's default costs give zero-bubble schedules a W (issue 36, item 5) ------------------

TEST(CliSimulate, WithoutCostWZeroBubbleSchedulesSplitTheBackwardEvenly) {
  auto bubble = [](const std::string& args) {
    Result r = RunCli("simulate --stages 4 --micro-batches 8 --json " + args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json one = bubble("--schedule 1f1b");
  // 1F1B unchanged: B is the whole backward, W 0.
  EXPECT_DOUBLE_EQ(one["makespan"].get<double>(), 22.0);
  for (const char* k : {"zb-h1", "zb-v", "dualpipev"}) {
    const nlohmann::json zb = bubble(std::string("--schedule ") + k);
    EXPECT_LT(zb["bubble_fraction"].get<double>(), one["bubble_fraction"].get<double>()) << k;
    // The same as spelling out I = W = B / 2.
    EXPECT_EQ(zb, bubble(std::string("--schedule ") + k + " --cost-b 0.5 --cost-w 0.5")) << k;
  }
  // Given explicitly, --cost-w 0 is taken as it is.
  EXPECT_DOUBLE_EQ(bubble("--schedule zb-h1 --cost-w 0")["makespan"].get<double>(),
                   bubble("--schedule zb-h1 --cost-b 1 --cost-w 0")["makespan"].get<double>());
}

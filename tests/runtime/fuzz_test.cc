// Fuzzing the parsers of everything pipewright reads from files (issue 16, part 6): the plan
// and model-cost JSON, the schedule program text, the checkpoint manifest and the safetensors
// reader. A deterministic mutation driver under GoogleTest: each target starts from valid
// inputs and feeds a fixed budget of mutants (bit flips, byte changes, insertions, deletions,
// truncations, splices, interesting numbers and JSON tokens) to the parser, which must return a
// value or an error and never crash, hang or read out of bounds (run under
// `scripts/test --sanitize address` for the last). Every input is a function of the seed, so a
// failure reproduces; PIPEWRIGHT_FUZZ_ITERATIONS raises the budget (the default keeps CI fast)
// and PIPEWRIGHT_FUZZ_SEED=N draws another sequence of mutants (default 0).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "pipewright/checkpoint.h"
#include "pipewright/data.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"
#include "runtime/train_state.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

int64_t Iterations() {
  const char* v = std::getenv("PIPEWRIGHT_FUZZ_ITERATIONS");
  return v != nullptr ? std::max<int64_t>(1, std::atoll(v)) : 3000;
}

uint64_t Seed() {
  const char* v = std::getenv("PIPEWRIGHT_FUZZ_SEED");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 0;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string Mutate(const std::vector<std::string>& seeds) {
    std::string s = seeds[Pick(seeds.size())];
    const int rounds = 1 + static_cast<int>(Pick(4));
    for (int r = 0; r < rounds; ++r) MutateOnce(s, seeds);
    return s;
  }

 private:
  size_t Pick(size_t n) {
    return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_);
  }

  void MutateOnce(std::string& s, const std::vector<std::string>& seeds) {
    static const char* const kTokens[] = {"0",
                                          "-1",
                                          "1e308",
                                          "-1e308",
                                          "1e-320",
                                          "NaN",
                                          "null",
                                          "true",
                                          "\"\"",
                                          "[]",
                                          "{}",
                                          "[",
                                          "{",
                                          "\"",
                                          ",",
                                          ":",
                                          "9223372036854775807",
                                          "-9223372036854775808",
                                          "18446744073709551615",
                                          "4294967296",
                                          "2147483648",
                                          "\\u0000",
                                          "\xff\xfe",
                                          "@s",
                                          "F",
                                          "B",
                                          "W",
                                          "rank 0:",
                                          "\n"};
    const size_t at = Pick(s.size() + 1);
    switch (Pick(8)) {
      case 0:  // flip a bit
        if (!s.empty()) s[at % s.size()] ^= static_cast<char>(1u << Pick(8));
        break;
      case 1:  // replace a byte
        if (!s.empty()) s[at % s.size()] = static_cast<char>(Pick(256));
        break;
      case 2:  // insert bytes
        s.insert(at, std::string(1 + Pick(4), static_cast<char>(Pick(256))));
        break;
      case 3:  // delete a range
        if (!s.empty()) s.erase(at % s.size(), 1 + Pick(16));
        break;
      case 4:  // truncate
        s.resize(at);
        break;
      case 5: {  // splice another seed's tail
        const std::string& other = seeds[Pick(seeds.size())];
        s = s.substr(0, at) + other.substr(Pick(other.size() + 1));
        break;
      }
      case 6:  // an interesting token
        s.insert(at, kTokens[Pick(sizeof(kTokens) / sizeof(kTokens[0]))]);
        break;
      default: {  // replace a run of digits with an interesting number
        const size_t d = s.find_first_of("0123456789", at);
        if (d == std::string::npos) break;
        size_t e = d;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        s.replace(d, e - d, kTokens[11 + Pick(6)]);
        break;
      }
    }
  }

  std::mt19937_64 rng_;
};

// Feeds `Iterations()` mutants of `seeds` to `parse`; each must return within a second.
void Fuzz(const std::string& target, const std::vector<std::string>& seeds,
          const std::function<void(const std::string&)>& parse) {
  for (const std::string& s : seeds) parse(s);  // the seeds themselves
  Mutator m(std::hash<std::string>{}(target) + Seed() * 0x9e3779b97f4a7c15ull);
  const int64_t n = Iterations();
  for (int64_t i = 0; i < n; ++i) {
    const std::string input = m.Mutate(seeds);
    const auto start = std::chrono::steady_clock::now();
    parse(input);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_LT(s, 1.0) << target << ": input " << i << " (seed " << Seed() << ") took " << s
                      << " s: " << ::testing::PrintToString(input.substr(0, 400));
  }
}

LayerGraph Tiny() {
  auto g = PresetModel("gpt-tiny", 2);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

TEST(Fuzz, PlanAndModelJson) {
  const ModelCosts model = ToModelCosts(Tiny());
  DeviceSpec devices;
  devices.count = 4;
  PartitionOptions o;
  o.pp = 2;
  o.dp = 2;
  o.micro_batches = 4;
  std::vector<std::string> plans;
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZbH1}) {
    o.schedule = kind;
    auto plan = Partition(model, devices, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back(PlanToJson(*plan));
  }
  int accepted = 0;
  Fuzz("plan", plans, [&](const std::string& text) {
    accepted += PlanFromJson(text).ok();
    (void)PlanFromJson(text, &model);
    (void)ValidatePlanJson(text);
  });
  EXPECT_GE(accepted, 1);
  Fuzz("model", {ModelCostsToJson(model)},
       [](const std::string& text) { (void)ModelCostsFromJson(text); });
}

TEST(Fuzz, ScheduleProgramText) {
  std::vector<std::string> seeds;
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kInterleaved, ScheduleKind::kZbV}) {
    const int chunks = kind == ScheduleKind::k1F1B ? 1 : 2;
    auto s = GenerateSchedule({kind, 2, 4, chunks});
    ASSERT_TRUE(s.ok()) << s.status();
    seeds.push_back(ToText(*s));
  }
  Fuzz("program", seeds, [](const std::string& text) { (void)ParseProgram(text); });
}

class FuzzFiles : public testing_util::ScratchDirTest {};

TEST_F(FuzzFiles, CheckpointManifestAndSafetensors) {
  const LayerGraph graph = Tiny();
  BatchLayout layout;
  layout.micro_batches = 4;
  layout.micro_batch_size = 2;
  layout.seq_len = graph.shape().seq_len;
  TrainOptions options;
  internal::ManifestInfo info;
  info.graph = &graph;
  info.options = &options;
  info.layout = layout;
  info.step = 3;
  const std::string manifest = internal::BuildManifest(info);
  // With this run's settings too: the comparisons that warn (schedule, optimizer, data, dp)
  // read the same fields, so a damaged 1e300 must never reach an integer or float conversion.
  internal::RunSettings run;
  run.seed = options.seed;
  run.layout = layout;
  Fuzz("manifest", {manifest}, [&](const std::string& text) {
    (void)internal::CheckManifest("ckpt", text, graph, layout, OptimizerKind::kAdamW);
    (void)internal::CheckManifest("ckpt", text, graph, layout, OptimizerKind::kAdamW, &run);
  });

  // What the fuzzer found (UBSan: step x global batch overflowed): out-of-range numbers in a
  // manifest are an error naming the field, not arithmetic on them.
  for (const auto& [from, to, field] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"step\": 3", "\"step\": 9223372036854775807", "step"},
           {"\"step\": 3", "\"step\": 18446744073709551615", "step"},
           {"\"step\": 3", "\"step\": -3", "step"}}) {
    std::string text = manifest;
    const size_t at = text.rfind(from);  // the top-level step (keys are sorted)
    ASSERT_NE(at, std::string::npos) << from << " not in " << manifest;
    text.replace(at, from.size(), to);
    auto r = internal::CheckManifest("ckpt", text, graph, layout, OptimizerKind::kAdamW);
    ASSERT_FALSE(r.ok()) << to;
    EXPECT_NE(std::string(r.status().message()).find(field), std::string::npos) << r.status();
  }

  const std::string path = Path("x.safetensors");
  NamedTensors tensors = {{"a", Tensor::FromVector({2, 3}, {1, 2, 3, 4, 5, 6})},
                          {"b.weight", Tensor::FromVector({1}, {7})}};
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int accepted = 0;
  Fuzz("safetensors", {bytes}, [&](const std::string& data) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
    accepted += ReadSafetensors(path).ok();
  });
  EXPECT_GE(accepted, 1);
}

// The ecosystem's token files (runtime/token_formats.cc): mutated Megatron indices (over a fixed
// .bin) and llm.c shards either open, and then every sample reads inside the files (ASan checks
// it), or fail naming the problem.
TEST_F(FuzzFiles, MegatronIndicesAndLlmcShards) {
  std::string text;
  for (int i = 0; i < 20; ++i) text += "to be or not to be ";
  auto put = [](std::string* s, const void* p, size_t n) {
    s->append(static_cast<const char*>(p), n);
  };
  std::ofstream(Path("m.bin"), std::ios::binary) << text;
  std::string idx("MMIDIDX\0\0", 9);
  const uint64_t version = 1, sequences = 3, documents = 4;
  put(&idx, &version, 8);
  idx.push_back(1);  // uint8
  put(&idx, &sequences, 8);
  put(&idx, &documents, 8);
  const int32_t third = static_cast<int32_t>(text.size() / 3);
  for (int i = 0; i < 3; ++i) put(&idx, &third, 4);
  for (int64_t at : {int64_t{0}, int64_t{third}, int64_t{2 * third}}) put(&idx, &at, 8);
  for (int64_t d : {0, 1, 2, 3}) put(&idx, &d, 8);
  std::string shard;
  const int32_t header[3] = {20240520, 1, static_cast<int32_t>(text.size())};
  put(&shard, header, sizeof(header));
  shard.resize(1024, '\0');
  for (unsigned char c : text) shard.append({static_cast<char>(c), '\0'});
  int accepted = 0;
  auto read_all = [&](const std::string& spec) {
    auto ds = OpenDataset(spec, 8, 3);
    if (!ds.ok()) return;
    ++accepted;
    std::vector<int32_t> out(9);
    for (int64_t i = 0; i < 64; ++i) (*ds)->Tokens(i, 8, out.data());
  };
  Fuzz("megatron index", {idx}, [&](const std::string& data) {
    std::ofstream(Path("m.idx"), std::ios::binary | std::ios::trunc) << data;
    read_all(Path("m"));
  });
  Fuzz("llm.c shard", {shard}, [&](const std::string& data) {
    std::ofstream(Path("s.bin"), std::ios::binary | std::ios::trunc) << data;
    read_all(Path("s.bin"));
  });
  EXPECT_GE(accepted, 2);
}

}  // namespace
}  // namespace pipewright

#include "pipewright/data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> SampleOf(const TokenDataset& d, int64_t index, int64_t seq_len) {
  std::vector<int32_t> out(seq_len + 1, -7);
  d.Tokens(index, seq_len, out.data());
  return out;
}

std::vector<int32_t> Row(const Tensor& t, int64_t b) {
  const int32_t* p = t.data<int32_t>() + b * t.dim(1);
  return std::vector<int32_t>(p, p + t.dim(1));
}

TEST(SyntheticTest, DeterministicPerSeedAndIndex) {
  auto a = SyntheticDataset(32, 5), b = SyntheticDataset(32, 5), c = SyntheticDataset(32, 6);
  EXPECT_FALSE(a->Describe().empty());
  int differ_seed = 0, differ_index = 0;
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(SampleOf(*a, i, 24), SampleOf(*b, i, 24));
    EXPECT_EQ(SampleOf(*a, i, 24), SampleOf(*a, i, 24));  // no hidden state
    differ_seed += SampleOf(*a, i, 24) != SampleOf(*c, i, 24);
    differ_index += SampleOf(*a, i, 24) != SampleOf(*a, i + 1, 24);
  }
  EXPECT_GE(differ_seed, 15);
  EXPECT_GE(differ_index, 15);
  // Order of calls does not matter.
  auto late = SampleOf(*a, 1000, 24);
  auto d = SyntheticDataset(32, 5);
  EXPECT_EQ(SampleOf(*d, 1000, 24), late);
  // A shorter window is a prefix of a longer one.
  auto s8 = SampleOf(*a, 3, 8), s24 = SampleOf(*a, 3, 24);
  EXPECT_TRUE(std::equal(s8.begin(), s8.end(), s24.begin()));
}

TEST(SyntheticTest, LettersAndPeriodic) {
  auto d = SyntheticDataset(32, 1);
  std::vector<int> periods_seen(9, 0);
  for (int64_t i = 0; i < 200; ++i) {
    auto s = SampleOf(*d, i, 32);
    for (int32_t t : s) {
      ASSERT_GE(t, 'a');
      ASSERT_LE(t, 'p');
    }
    int found = 0;
    for (int p = 2; p <= 8 && !found; ++p) {
      bool ok = true;
      for (size_t t = p; t < s.size(); ++t) ok &= s[t] == s[t - p];
      if (ok) found = p;
    }
    ASSERT_NE(found, 0) << "sample " << i << " is not periodic with period 2..8";
    ++periods_seen[found];
  }
  int distinct = 0;
  for (int c : periods_seen) distinct += c > 0;
  EXPECT_GE(distinct, 4);  // the period varies between samples
}

TEST(BatchTest, IndependentOfLayoutAndShifted) {
  const int64_t T = 16;
  auto d = SyntheticDataset(T, 11);
  BatchLayout four{.micro_batches = 4, .micro_batch_size = 2, .seq_len = T, .replicas = 1};
  BatchLayout one{.micro_batches = 1, .micro_batch_size = 8, .seq_len = T, .replicas = 1};
  EXPECT_EQ(four.global_batch(), 8);
  EXPECT_EQ(one.global_batch(), 8);
  StepBatch a = MakeStepBatch(*d, four, 0, 0);
  StepBatch b = MakeStepBatch(*d, one, 0, 0);
  EXPECT_EQ(a.step, 0);
  ASSERT_EQ(a.inputs.size(), 4u);
  ASSERT_EQ(a.targets.size(), 4u);
  ASSERT_EQ(b.inputs.size(), 1u);
  EXPECT_EQ(a.inputs[0].shape(), (std::vector<int64_t>{2, T}));
  EXPECT_EQ(a.inputs[0].dtype(), DType::kI32);
  EXPECT_EQ(b.inputs[0].shape(), (std::vector<int64_t>{8, T}));
  for (int64_t g = 0; g < 8; ++g) {
    EXPECT_EQ(Row(a.inputs[g / 2], g % 2), Row(b.inputs[0], g)) << g;
    EXPECT_EQ(Row(a.targets[g / 2], g % 2), Row(b.targets[0], g)) << g;
    auto s = SampleOf(*d, g, T);
    EXPECT_EQ(Row(b.inputs[0], g), std::vector<int32_t>(s.begin(), s.end() - 1));
    EXPECT_EQ(Row(b.targets[0], g), std::vector<int32_t>(s.begin() + 1, s.end()));
    // Targets are the inputs shifted by one.
    auto in = Row(b.inputs[0], g), tg = Row(b.targets[0], g);
    for (int64_t t = 0; t + 1 < T; ++t) EXPECT_EQ(tg[t], in[t + 1]);
  }
  // Step 1 continues at global sample 8.
  StepBatch a1 = MakeStepBatch(*d, four, 1, 0);
  StepBatch b1 = MakeStepBatch(*d, one, 1, 0);
  EXPECT_EQ(a1.step, 1);
  auto s8 = SampleOf(*d, 8, T);
  EXPECT_EQ(Row(a1.inputs[0], 0), std::vector<int32_t>(s8.begin(), s8.end() - 1));
  EXPECT_EQ(Row(b1.inputs[0], 0), Row(a1.inputs[0], 0));
  auto s15 = SampleOf(*d, 15, T);
  EXPECT_EQ(Row(a1.inputs[3], 1), std::vector<int32_t>(s15.begin(), s15.end() - 1));
  EXPECT_NE(Row(a1.inputs[0], 0), Row(a.inputs[0], 0));
}

TEST(BatchTest, SampleIndexWithReplicas) {
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 3, .seq_len = 4, .replicas = 2};
  EXPECT_EQ(l.global_batch(), 12);
  EXPECT_EQ(l.SampleIndex(0, 0, 0, 0), 0);
  EXPECT_EQ(l.SampleIndex(0, 0, 1, 2), 5);
  EXPECT_EQ(l.SampleIndex(0, 1, 0, 0), 6);
  EXPECT_EQ(l.SampleIndex(2, 1, 1, 2), 24 + 11);
  auto d = SyntheticDataset(4, 2);
  StepBatch r1 = MakeStepBatch(*d, l, 2, 1);
  auto s = SampleOf(*d, 24 + 6, 4);
  EXPECT_EQ(Row(r1.inputs[0], 0), std::vector<int32_t>(s.begin(), s.end() - 1));
}

class TextDataTest : public testing_util::ScratchDirTest {
 protected:
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = Path(name);
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
};

TEST_F(TextDataTest, WindowsAreSubstrings) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "The quick brown fox " + std::to_string(i) + " jumps. ";
  text += "\xff\x80";  // high bytes are tokens 255 and 128, not negative
  std::string path = Write("corpus.txt", text);
  const int64_t T = 16;
  auto d = OpenTextDataset(path, T, 3);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE((*d)->Describe().find(std::to_string(text.size())), std::string::npos);
  std::set<std::string> distinct;
  for (int64_t i = 0; i < 300; ++i) {
    auto s = SampleOf(**d, i, T);
    std::string window;
    for (int32_t t : s) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, 256);
      window.push_back(static_cast<char>(t));
    }
    ASSERT_NE(text.find(window), std::string::npos) << "sample " << i;
    distinct.insert(window);
  }
  EXPECT_GT(distinct.size(), 100u);
  // Deterministic per (seed, index); the seed moves the windows.
  auto again = OpenTextDataset(path, T, 3);
  auto other = OpenTextDataset(path, T, 4);
  ASSERT_TRUE(again.ok() && other.ok());
  int same = 0;
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(SampleOf(**d, i, T), SampleOf(**again, i, T));
    same += SampleOf(**d, i, T) == SampleOf(**other, i, T);
  }
  EXPECT_LT(same, 5);
  // Through OpenDataset, too.
  auto via = OpenDataset(path, T, 3);
  ASSERT_TRUE(via.ok());
  EXPECT_EQ(SampleOf(**via, 7, T), SampleOf(**d, 7, T));
}

TEST_F(TextDataTest, SmallestFileCoversEveryByte) {
  // seq_len + 2 bytes is the minimum; both windows must stay inside the file.
  std::string path = Write("min.txt", "abcdef");  // 6 bytes, seq_len 4
  auto d = OpenTextDataset(path, 4, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  for (int64_t i = 0; i < 50; ++i) {
    auto s = SampleOf(**d, i, 4);
    std::string w;
    for (int32_t t : s) w.push_back(static_cast<char>(t));
    EXPECT_TRUE(w == "abcde" || w == "bcdef") << w;
  }
}

TEST_F(TextDataTest, ShortAndMissingFiles) {
  std::string path = Write("short.txt", "abcde");  // seq_len 4 needs 6 bytes
  auto s = OpenTextDataset(path, 4, 1);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = OpenTextDataset(Write("empty.txt", ""), 4, 1);
  EXPECT_FALSE(empty.ok());
  auto missing = OpenTextDataset((root_ / "nope.txt").string(), 4, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  auto via = OpenDataset((root_ / "nope.txt").string(), 4, 1);
  EXPECT_EQ(via.status().code(), absl::StatusCode::kNotFound);
  auto synth = OpenDataset("synthetic", 4, 1);
  ASSERT_TRUE(synth.ok());
  EXPECT_EQ(SampleOf(**synth, 2, 4), SampleOf(*SyntheticDataset(32, 1), 2, 4));
}

void ExpectSameBatch(const StepBatch& a, const StepBatch& b) {
  EXPECT_EQ(a.step, b.step);
  ASSERT_EQ(a.inputs.size(), b.inputs.size());
  for (size_t j = 0; j < a.inputs.size(); ++j) {
    for (int64_t r = 0; r < a.inputs[j].dim(0); ++r) {
      EXPECT_EQ(Row(a.inputs[j], r), Row(b.inputs[j], r));
      EXPECT_EQ(Row(a.targets[j], r), Row(b.targets[j], r));
    }
  }
}

TEST(DataLoaderTest, YieldsConsecutiveStepsLikeMakeStepBatch) {
  std::shared_ptr<const Dataset> d = SyntheticDataset(8, 9);
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 3, .seq_len = 8, .replicas = 1};
  DataLoader loader(d, l, 0, /*first_step=*/5, /*prefetch=*/2);
  for (int64_t step = 5; step < 12; ++step) {
    StepBatch b = loader.Next();
    EXPECT_EQ(b.step, step);
    ExpectSameBatch(b, MakeStepBatch(*d, l, step, 0));
  }
}

// A dataset that takes `delay` per sample: the loader cannot keep ahead of a consumer that
// takes nothing, so Next waits, and wait_time says how long.
class SlowDataset final : public Dataset {
 public:
  explicit SlowDataset(absl::Duration delay) : delay_(delay) {}
  std::string Describe() const override { return "slow"; }
  SampleSpec Spec() const override { return {{2}, DType::kF32, {1}, DType::kI32}; }
  void Sample(int64_t index, void* input, void* target) const override {
    absl::SleepFor(delay_);
    static_cast<float*>(input)[0] = static_cast<float>(index);
    static_cast<float*>(input)[1] = -static_cast<float>(index);
    static_cast<int32_t*>(target)[0] = static_cast<int32_t>(index % 7);
  }

 private:
  absl::Duration delay_;
};

TEST(DataLoaderTest, WaitTimeCountsTheTimeNextWaited) {
  auto d = std::make_shared<SlowDataset>(absl::Milliseconds(10));
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 2, .seq_len = 1, .replicas = 1};
  DataLoader loader(d, l, 0, 0, /*prefetch=*/1);
  const absl::Time start = absl::Now();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(loader.Next().step, i);
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  const double waited = absl::ToDoubleSeconds(loader.wait_time());
  // Each step needs 4 samples x 10 ms; the first could not have been ready before it was asked.
  EXPECT_GE(waited, 0.035);
  EXPECT_LE(waited, elapsed);
}

// Any sample shape and dtype: the loader stacks samples along a new leading dimension.
TEST(BatchTest, CustomSampleSpec) {
  SlowDataset d(absl::ZeroDuration());
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 3, .seq_len = 1, .replicas = 1};
  StepBatch b = MakeStepBatch(d, l, 1, 0);
  ASSERT_EQ(b.inputs.size(), 2u);
  EXPECT_EQ(b.inputs[1].shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(b.inputs[1].dtype(), DType::kF32);
  EXPECT_EQ(b.targets[1].shape(), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(b.targets[1].dtype(), DType::kI32);
  // Micro-batch 1, sequence 2 of step 1 is global sample 6 + 3 + 2 = 11.
  EXPECT_EQ(b.inputs[1].data<float>()[2 * 2], 11.0f);
  EXPECT_EQ(b.inputs[1].data<float>()[2 * 2 + 1], -11.0f);
  EXPECT_EQ(b.targets[1].data<int32_t>()[2], 11 % 7);
}

TEST(DataLoaderTest, DestructsWithBatchesQueued) {
  std::shared_ptr<const Dataset> d = SyntheticDataset(8, 9);
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 2, .seq_len = 8, .replicas = 1};
  for (int prefetch : {1, 4}) {
    auto loader = std::make_unique<DataLoader>(d, l, 0, 0, prefetch);
    StepBatch b = loader->Next();
    EXPECT_EQ(b.step, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the queue fill
    loader.reset();                                              // must join without hanging
  }
  { DataLoader never_used(d, l, 0, 3, 2); }
  SUCCEED();
}

// --- Token files -----------------------------------------------------------------------------

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST_F(TextDataTest, PreparedTokenFileGivesTheTextFilesSamples) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "Now is the winter of our discontent " + std::to_string(i);
  text += "\xff\x80";
  const std::string txt = Write("corpus.txt", text), tok = Path("corpus.tokens");
  auto info = PrepareByteTokenFile(txt, tok);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens, static_cast<int64_t>(text.size()));
  EXPECT_EQ(info->vocab_size, 256);
  EXPECT_EQ(info->dtype(), "uint16");  // bytes fit uint16; there is no uint8 format
  EXPECT_FALSE(fs::exists(tok + ".tmp"));
  // The header, as a reader of the file sees it.
  const std::string bytes = ReadAll(tok);
  ASSERT_EQ(bytes.size(), kTokenFileHeaderBytes + 2 * text.size());
  EXPECT_EQ(bytes.substr(0, 9), "PWTOKENS\n");
  EXPECT_EQ(bytes[kTokenFileHeaderBytes - 1], '\n');
  const std::string header = bytes.substr(0, kTokenFileHeaderBytes);
  for (const char* field : {"\"format\":\"pipewright-tokens\"", "\"dtype\":\"uint16\"",
                            "\"vocab_size\":256", "\"version\":1"}) {
    EXPECT_NE(header.find(field), std::string::npos) << field << " in " << header;
  }
  EXPECT_NE(header.find("\"tokens\":" + std::to_string(text.size())), std::string::npos);
  auto read = ReadTokenFileInfo(tok);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tokens, info->tokens);
  // Same windows as the text (Note [Memory-mapped data]: both draw positions alike).
  const int64_t T = 16;
  auto a = OpenDataset(txt, T, 5);
  auto b = OpenDataset(tok, T, 5);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_NE((*b)->Describe().find("tokens:"), std::string::npos) << (*b)->Describe();
  EXPECT_EQ((*b)->vocab_size(), 256);
  for (int64_t i = 0; i < 200; ++i) ASSERT_EQ(SampleOf(**a, i, T), SampleOf(**b, i, T)) << i;
  EXPECT_TRUE(CheckVocabulary(**b, 256).ok());
}

TEST_F(TextDataTest, Uint32TokenFiles) {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 500; ++i) tokens.push_back(65000 + 3 * i);  // ascending, > 2^16
  const std::string path = Path("big.tokens");
  ASSERT_TRUE(WriteTokenFile(path, tokens, 70000).ok());
  auto info = ReadTokenFileInfo(path);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype(), "uint32");
  EXPECT_EQ(info->vocab_size, 70000);
  EXPECT_EQ(info->tokens, 500);
  auto d = OpenDataset(path, 8, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->vocab_size(), 70000);
  for (int64_t i = 0; i < 50; ++i) {
    auto s = SampleOf(**d, i, 8);
    ASSERT_GE(s[0], 65000);
    ASSERT_EQ((s[0] - 65000) % 3, 0);
    for (size_t t = 1; t < s.size(); ++t) ASSERT_EQ(s[t], s[t - 1] + 3) << "sample " << i;
  }
  // The byte-level presets cannot read it.
  absl::Status v = CheckVocabulary(**d, 256);
  EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("70000"), std::string::npos) << v;
  // A vocabulary that fits 16 bits is written as uint16.
  ASSERT_TRUE(WriteTokenFile(path, {1, 2, 3, 65535}, 65536).ok());
  EXPECT_EQ(ReadTokenFileInfo(path)->dtype(), "uint16");
  EXPECT_FALSE(WriteTokenFile(path, {1, 256}, 256).ok());  // token >= vocabulary
}

TEST_F(TextDataTest, RejectsBadTokenFiles) {
  std::vector<uint32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 'a' + i % 26;
  const std::string good = Path("good.tokens");
  ASSERT_TRUE(WriteTokenFile(good, tokens, 256).ok());
  const std::string bytes = ReadAll(good);
  ASSERT_TRUE(OpenDataset(good, 8, 1).ok());
  auto expect_bad = [&](const std::string& name, const std::string& contents,
                        const std::string& why) {
    const std::string path = Write(name, contents);
    auto d = OpenDataset(path, 8, 1);
    ASSERT_FALSE(d.ok()) << name;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_NE(d.status().message().find(path), std::string::npos) << d.status();
    EXPECT_NE(d.status().message().find(why), std::string::npos) << d.status();
  };
  // A header that is not JSON, or lacks a field, or names another dtype.
  std::string broken = bytes;
  broken[9] = '#';
  expect_bad("broken.tokens", broken, "malformed header");
  std::string no_field = bytes;
  no_field.replace(no_field.find("\"tokens\""), 8, "\"tokenz\"");
  expect_bad("no_field.tokens", no_field, "malformed header");
  std::string dtype = bytes;
  dtype.replace(dtype.find("uint16"), 6, "int8xx");
  expect_bad("dtype.tokens", dtype, "dtype 'int8xx'");
  // The size disagrees with the header's count.
  expect_bad("short.tokens", bytes.substr(0, bytes.size() - 2), "bytes; the header's 64");
  expect_bad("long.tokens", bytes + "xy", "bytes; the header's 64");
  expect_bad("tiny.tokens", "PWTOKENS\n{}", "shorter than the 256-byte header");
  // A token at or above the vocabulary (token 10 := 256 + 1).
  std::string high = bytes;
  high[kTokenFileHeaderBytes + 2 * 10] = 1;
  high[kTokenFileHeaderBytes + 2 * 10 + 1] = 1;
  expect_bad("high.tokens", high, "token 10 is 257, not below the vocabulary size 256");
  // A .tokens file without the header is not taken for text.
  expect_bad("text.tokens", std::string(300, 'a'), "no PWTOKENS header");
  // Too few tokens for one sample.
  ASSERT_TRUE(WriteTokenFile(Path("few.tokens"), {1, 2, 3}, 256).ok());
  auto few = OpenDataset(Path("few.tokens"), 8, 1);
  EXPECT_EQ(few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ReadTokenFileInfo(Path("nope.tokens")).ok());
  // prepare: a missing input is NotFound, and leaves no output behind.
  auto missing = PrepareByteTokenFile(Path("nope.txt"), Path("out.tokens"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(Path("out.tokens")));
}

TEST(DelayTest, SameTokensSlower) {
  std::shared_ptr<const TokenDataset> base = SyntheticDataset(8, 3);
  auto slow = WithSampleDelay(base, absl::Milliseconds(2));
  EXPECT_NE(slow->Describe().find("benchmark delay"), std::string::npos);
  const absl::Time start = absl::Now();
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(SampleOf(*slow, i, 8), SampleOf(*base, i, 8));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(10));  // a lower bound: sleeps are >= asked
}

// --- Loader workers ----------------------------------------------------------------------------

// Synthetic samples that take an index-dependent time (0-2 ms), so that concurrent workers finish
// steps out of order, and that record which threads built them and how many were built.
class JitterDataset final : public Dataset {
 public:
  std::string Describe() const override { return "jitter"; }
  SampleSpec Spec() const override { return base_->Spec(); }
  void Sample(int64_t index, void* input, void* target) const override {
    absl::SleepFor(absl::Microseconds(1000 * ((index * 7 + index / 5) % 3)));
    base_->Sample(index, input, target);
    built.fetch_add(1);
    absl::MutexLock lock(&mu_);
    threads_.insert(std::this_thread::get_id());
  }
  std::set<std::thread::id> threads() const {
    absl::MutexLock lock(&mu_);
    return threads_;
  }
  mutable std::atomic<int64_t> built{0};

 private:
  std::unique_ptr<TokenDataset> base_ = SyntheticDataset(8, 11);
  mutable absl::Mutex mu_;
  mutable std::set<std::thread::id> threads_;
};

TEST(DataLoaderTest, SameBatchesInStepOrderForAnyWorkerCount) {
  auto d = std::make_shared<JitterDataset>();
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 2, .seq_len = 8, .replicas = 2};
  for (int workers : {0, 1, 2, 3, 5}) {
    for (int prefetch : {1, 3}) {
      DataLoader loader(d, l, /*replica=*/1, /*first_step=*/4, prefetch, workers);
      for (int64_t step = 4; step < 14; ++step) {
        StepBatch b = loader.Next();
        ASSERT_EQ(b.step, step) << workers << " workers";
        ExpectSameBatch(b, MakeStepBatch(*d, l, step, 1));
      }
    }
  }
}

TEST(DataLoaderTest, ZeroWorkersBuildOnTheCallersThread) {
  BatchLayout l{.micro_batches = 1, .micro_batch_size = 2, .seq_len = 8, .replicas = 1};
  auto inline_data = std::make_shared<JitterDataset>();
  {
    DataLoader loader(inline_data, l, 0, 0, /*prefetch=*/2, /*workers=*/0);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(loader.Next().step, i);
    EXPECT_GT(loader.wait_time(), absl::ZeroDuration());  // building is all waiting
  }
  EXPECT_EQ(inline_data->threads(), std::set<std::thread::id>{std::this_thread::get_id()});
  EXPECT_EQ(inline_data->built.load(), 3 * 2);  // nothing built ahead
  auto worker_data = std::make_shared<JitterDataset>();
  {
    DataLoader loader(worker_data, l, 0, 0, /*prefetch=*/2, /*workers=*/2);
    for (int i = 0; i < 6; ++i) EXPECT_EQ(loader.Next().step, i);
  }
  EXPECT_EQ(worker_data->threads().count(std::this_thread::get_id()), 0u);
}

TEST(DataLoaderTest, WorkersStayWithinTheBound) {
  BatchLayout l{.micro_batches = 2, .micro_batch_size = 2, .seq_len = 8, .replicas = 1};
  for (int workers : {1, 3, 6}) {
    auto d = std::make_shared<JitterDataset>();
    DataLoader loader(d, l, 0, 0, /*prefetch=*/2, workers);
    const int64_t capacity = std::max(2, workers), per_step = 4;
    EXPECT_EQ(loader.Next().step, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(60));  // let the workers run ahead
    // Steps 1..capacity at most: step 0 was taken; claims stop `capacity` steps ahead of it.
    EXPECT_LE(d->built.load(), per_step * (1 + capacity)) << workers << " workers";
    EXPECT_EQ(loader.Next().step, 1);
  }
}

}  // namespace
}  // namespace pipewright

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "pipewright/train.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public testing_util::ScratchDirTest {};

struct TrainerSetup {
  int64_t micro_batches = 1;
  TrainOptions train;
};

TrainerSetup Options(int64_t micro_batches, int64_t steps) {
  TrainerSetup s;
  s.micro_batches = micro_batches;
  s.train.steps = steps;
  s.train.seed = 1;
  return s;
}

LayerGraph Tiny(int64_t mbs) {
  auto g = PresetModel("gpt-tiny", mbs);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

std::unique_ptr<Trainer> MakeTrainer(const LayerGraph& g, const TrainerSetup& s) {
  auto t = Trainer::Create(g, s.micro_batches, s.train);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

std::vector<double> RunSteps(Trainer& t, int steps) {
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    auto r = t.Step();
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    losses.push_back(r->loss);
  }
  return losses;
}

std::map<std::string, std::vector<float>> Weights(const Trainer& t) {
  std::map<std::string, std::vector<float>> out;
  for (Parameter* p : t.Parameters()) out[p->name] = p->value.ToVector();
  return out;
}

TEST_F(TrainerTest, LossFallsOnSyntheticData) {
  LayerGraph g = Tiny(4);
  auto t = MakeTrainer(g, Options(2, 30));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->global_batch(), 8);
  std::vector<StepResult> results;
  for (int i = 0; i < 30; ++i) {
    auto r = t->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step, i);
    EXPECT_TRUE(std::isfinite(r->loss));
    EXPECT_GT(r->grad_norm, 0.0);
    EXPECT_GT(r->lr, 0.0f);
    EXPECT_GE(r->data_wait_s, 0.0);
    results.push_back(*r);
  }
  EXPECT_EQ(t->step(), 30);
  // Initial loss is about ln(256) for a freshly initialised byte model.
  EXPECT_NEAR(results[0].loss, std::log(256.0), 0.5);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += results[i].loss / 5;
  for (int i = 25; i < 30; ++i) last += results[i].loss / 5;
  EXPECT_LT(last, 0.8 * first) << "first " << first << " last " << last;
  // The schedule: warm-up (5 steps) to the peak, then decay.
  EXPECT_FLOAT_EQ(results[4].lr, t->PeakLr());
  EXPECT_LT(results[0].lr, results[4].lr);
  EXPECT_LT(results[29].lr, results[5].lr);
}

TEST_F(TrainerTest, SameSeedIsBitIdentical) {
  LayerGraph g = Tiny(4);
  auto a = MakeTrainer(g, Options(2, 4));
  auto b = MakeTrainer(g, Options(2, 4));
  ASSERT_TRUE(a && b);
  std::vector<double> la = RunSteps(*a, 4), lb = RunSteps(*b, 4);
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(Weights(*a), Weights(*b));

  TrainerSetup other = Options(2, 4);
  other.train.seed = 2;
  auto c = MakeTrainer(g, other);
  ASSERT_TRUE(c);
  EXPECT_NE(RunSteps(*c, 1)[0], la[0]);
}

TEST_F(TrainerTest, GradientAccumulationMatchesLargeMicroBatch) {
  LayerGraph g4 = Tiny(4), g8 = Tiny(8);
  auto acc = MakeTrainer(g4, Options(2, 4));
  auto big = MakeTrainer(g8, Options(1, 4));
  ASSERT_TRUE(acc && big);
  EXPECT_EQ(acc->global_batch(), big->global_batch());
  std::vector<double> la = RunSteps(*acc, 4), lb = RunSteps(*big, 4);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(la[i], lb[i], 1e-5 * std::fabs(lb[i])) << "step " << i;
  }
  // And the losses did move, so the comparison covers the updates too.
  EXPECT_NE(la[0], la[3]);
}

TEST_F(TrainerTest, SaveResumeIsBitIdentical) {
  LayerGraph g = Tiny(4);
  auto straight = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(straight);
  std::vector<double> ref = RunSteps(*straight, 6);
  ASSERT_EQ(ref.size(), 6u);

  auto first = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(first);
  std::vector<double> head = RunSteps(*first, 3);
  ASSERT_EQ(head.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(head[i], ref[i]);
  ASSERT_TRUE(first->Save(Path("ckpt")).ok());
  EXPECT_TRUE(fs::exists(Path("ckpt/manifest.json")));

  auto resumed = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(resumed);
  absl::Status s = resumed->Resume(Path("ckpt"));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resumed->step(), 3);
  EXPECT_EQ(Weights(*resumed), Weights(*first));
  std::vector<double> tail = RunSteps(*resumed, 3);
  ASSERT_EQ(tail.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(tail[i], ref[3 + i]) << "step " << 3 + i;
  EXPECT_EQ(resumed->step(), 6);
  EXPECT_EQ(Weights(*resumed), Weights(*straight));

  // Resuming a trainer that already ran some steps also rewinds to the checkpoint.
  auto ran = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(ran);
  RunSteps(*ran, 5);
  ASSERT_TRUE(ran->Resume(Path("ckpt")).ok());
  std::vector<double> again = RunSteps(*ran, 3);
  ASSERT_EQ(again.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(again[i], ref[3 + i]) << "step " << 3 + i;
}

TEST_F(TrainerTest, ResumeMismatchErrorsAndLeavesWeights) {
  LayerGraph g = Tiny(4);
  auto src = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(src);
  RunSteps(*src, 1);
  ASSERT_TRUE(src->Save(Path("ckpt")).ok());

  // A different model.
  auto other_graph =
      GptModel("gpt-tiny", {.layers = 2, .hidden = 64, .heads = 4, .seq = 32, .vocab = 256}, 4);
  ASSERT_TRUE(other_graph.ok());
  auto other = MakeTrainer(*other_graph, Options(2, 6));
  ASSERT_TRUE(other);
  auto before = Weights(*other);
  absl::Status s = other->Resume(Path("ckpt"));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(Weights(*other), before);
  EXPECT_EQ(other->step(), 0);

  // Same model, different global batch (micro-batches 4 instead of 2).
  auto wider = MakeTrainer(g, Options(4, 6));
  ASSERT_TRUE(wider);
  auto wb = Weights(*wider);
  EXPECT_FALSE(wider->Resume(Path("ckpt")).ok());
  EXPECT_EQ(Weights(*wider), wb);

  // A different optimizer.
  TrainerSetup sgd = Options(2, 6);
  sgd.train.optimizer.kind = OptimizerKind::kSgd;
  auto sgd_t = MakeTrainer(g, sgd);
  ASSERT_TRUE(sgd_t);
  auto sb = Weights(*sgd_t);
  EXPECT_FALSE(sgd_t->Resume(Path("ckpt")).ok());
  EXPECT_EQ(Weights(*sgd_t), sb);

  // Missing checkpoint.
  auto fresh = MakeTrainer(g, Options(2, 6));
  EXPECT_EQ(fresh->Resume(Path("nope")).code(), absl::StatusCode::kNotFound);
  // The fresh trainer still trains from step 0.
  auto r = fresh->Step();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->step, 0);
}

TEST_F(TrainerTest, MemoryAccounting) {
  LayerGraph g = Tiny(4);
  auto t = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(t);
  int64_t weights_bytes = 0;
  for (Parameter* p : t->Parameters()) weights_bytes += p->value.nbytes();
  // Weights + grads + two AdamW moments live on the trainer's allocator.
  EXPECT_GE(t->current_memory_bytes(), 4 * weights_bytes);
  RunSteps(*t, 2);
  EXPECT_GT(t->peak_memory_bytes(), 0);
  EXPECT_GE(t->peak_memory_bytes(), t->current_memory_bytes());
  // Activations made the peak exceed the steady state.
  EXPECT_GT(t->peak_memory_bytes(), 4 * weights_bytes);
}

TEST_F(TrainerTest, CreateRejectsBadOptions) {
  LayerGraph g = Tiny(4);
  EXPECT_FALSE(Trainer::Create(g, 0, Options(0, 6).train).ok());
  TrainOptions o = Options(2, 6).train;
  o.lr = 0;
  EXPECT_FALSE(Trainer::Create(g, 2, o).ok());
  // Data whose samples do not have the model's sequence length.
  auto wrong =
      Trainer::Create(g, 2, Options(2, 6).train, SyntheticDataset(g.shape().seq_len * 2, 1));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("sequence"), std::string::npos) << wrong.status();
  o = Options(2, 6).train;
  o.lr_scaling = LrScaling::kLinear;
  o.base_batch = 4;
  auto t = Trainer::Create(g, 2, o);
  ASSERT_TRUE(t.ok());
  EXPECT_FLOAT_EQ((*t)->PeakLr(), o.lr * 2);  // global batch 8 over base 4
}

TEST_F(TrainerTest, EvaluateCheckpoint) {
  LayerGraph g = Tiny(4);
  auto t = MakeTrainer(g, Options(2, 6));
  ASSERT_TRUE(t);
  RunSteps(*t, 2);
  ASSERT_TRUE(t->Save(Path("ckpt")).ok());
  auto r = EvaluateCheckpoint(Path("ckpt"), "synthetic", 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(std::isfinite(r->loss));
  EXPECT_GT(r->loss, 0.0);
  EXPECT_LT(r->loss, 7.0);
  EXPECT_NEAR(r->perplexity, std::exp(r->loss), 1e-9 * r->perplexity);
  EXPECT_EQ(r->model, "gpt-tiny");
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(r->tokens, 2 * 4 * 32);
  // Deterministic.
  auto r2 = EvaluateCheckpoint(Path("ckpt"), "synthetic", 2);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->loss, r->loss);

  EXPECT_FALSE(EvaluateCheckpoint(Path("ckpt"), "synthetic", 0).ok());
  EXPECT_EQ(EvaluateCheckpoint(Path("nope"), "synthetic", 1).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pipewright

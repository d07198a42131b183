// Incremental decoding (Note [Incremental decoding] in pipewright/layer.h) and the generation
// loop that uses it (runtime/generate.h, Note [Sampling] in pipewright/train.h): every cached
// step's logits against the full forward of the same window, window refills included, and the
// cached text against the recomputed one.
#include "runtime/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "pipewright/layer.h"
#include "pipewright/model.h"
#include "pipewright/train.h"

namespace pipewright {
namespace {

// gpt-tiny (T = 32) with its initial weights plus N(0, 0.1) noise, so that the attention is far
// from uniform and the logits far from zero.
struct Model {
  LayerGraph graph;
  std::unique_ptr<Stage> stage;
  int L = 0;  // layers up to the logits (the loss left out)
  int64_t T = 0, V = 0;
};

Model Noisy(const std::string& preset, uint64_t seed) {
  Model m{*PresetModel(preset, 1), nullptr};
  m.stage = *m.graph.Instantiate(0, m.graph.num_layers(), seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> noise(0.0f, 0.1f);
  for (Parameter* p : m.stage->Parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += noise(rng);
  }
  m.L = m.graph.num_layers() - 1;
  m.T = m.graph.shape().seq_len;
  m.V = 256;
  return m;
}

// The logits at the last position of `window` by every layer's Forward.
std::vector<float> FullForwardLast(Model& m, const std::vector<int32_t>& window) {
  Tensor x = Tensor::Empty({1, static_cast<int64_t>(window.size())}, DType::kI32);
  std::copy(window.begin(), window.end(), x.data<int32_t>());
  for (int i = 0; i < m.L; ++i) {
    Saved saved;
    x = *m.stage->layer(i).Forward(x, LayerContext{}, &saved);
  }
  const float* last = x.data<float>() + (x.dim(1) - 1) * m.V;
  return std::vector<float>(last, last + m.V);
}

// For GPT (learned positions) and Llama (rotary positions, grouped-query attention: its cache
// holds keys turned to their positions).
TEST(Generate, CachedStepsMatchTheFullForwardOfTheirWindowAcrossRefills) {
  for (const std::string preset : {"gpt-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    Model m = Noisy(preset, 11);
    ASSERT_EQ(m.T, 32);
    // A prompt within the window, and one longer than it (its first window is full at once).
    std::string longer(50, 'a');
    longer += 'b';
    const std::vector<std::string> prompts = {"ROMEO:", longer};
    for (const std::string& prompt : prompts) {
      GenerateOptions o;
      o.prompt = prompt;
      o.tokens = 3 * m.T + 7;
      o.temperature = 1.0;
      o.top_k = 0;
      o.seed = 5;
      std::vector<int32_t> text(prompt.begin(), prompt.end());  // every token so far
      std::vector<size_t> sizes;
      double worst = 0, smallest_max = 1e30;
      auto observe = [&](const std::vector<int32_t>& window, const float* logits, int64_t vocab) {
        ASSERT_EQ(vocab, m.V);
        ASSERT_LE(window.size(), static_cast<size_t>(m.T));
        ASSERT_LE(window.size(), text.size());
        EXPECT_TRUE(std::equal(window.begin(), window.end(), text.end() - window.size()))
            << "the window is not the latest tokens at step " << sizes.size();
        sizes.push_back(window.size());
        const std::vector<float> full = FullForwardLast(m, window);
        double diff = 0, max = 0;
        for (int64_t v = 0; v < vocab; ++v) {
          diff = std::max(diff, static_cast<double>(std::fabs(logits[v] - full[v])));
          max = std::max(max, static_cast<double>(std::fabs(full[v])));
        }
        worst = std::max(worst, diff / max);
        smallest_max = std::min(smallest_max, max);
      };
      GenerateResult r;
      ASSERT_TRUE(internal::Generate(
                      *m.stage, m.L, m.T, m.V, o,
                      [&](const std::string& piece) {
                        text.push_back(static_cast<unsigned char>(piece[0]));
                      },
                      &r, observe)
                      .ok());
      EXPECT_TRUE(r.kv_cache);
      ASSERT_EQ(sizes.size(), static_cast<size_t>(o.tokens));
      EXPECT_LE(worst, 1e-5) << "prompt of " << prompt.size();
      RecordProperty(preset + "_worst_relative_difference_prompt_" + std::to_string(prompt.size()),
                     std::to_string(worst));
      EXPECT_GT(smallest_max, 0.1) << "logits too close to zero to test anything";
      // Windows grow by one position a token; a full one (T) is followed by the last T/2 tokens.
      EXPECT_EQ(sizes[0], std::min<size_t>(prompt.size(), m.T));
      int refills = 0;
      for (size_t i = 1; i < sizes.size(); ++i) {
        if (sizes[i - 1] == static_cast<size_t>(m.T)) {
          EXPECT_EQ(sizes[i], static_cast<size_t>(m.T / 2)) << "step " << i;
          ++refills;
        } else {
          EXPECT_EQ(sizes[i], sizes[i - 1] + 1) << "step " << i;
        }
      }
      EXPECT_GE(refills, 5) << "prompt of " << prompt.size();
    }
  }
}

TEST(Generate, GreedyTextWithTheCacheIsTheRecomputedTextWithinTheWindow) {
  for (const char* preset : {"gpt-tiny", "mlp", "llama-tiny"}) {
    Model m = Noisy(preset, 12);
    GenerateOptions o;
    o.prompt = "ROMEO:";
    o.tokens = m.T - static_cast<int64_t>(o.prompt.size());  // the text fills the window
    o.temperature = 0;
    GenerateResult cached, full;
    ASSERT_TRUE(internal::Generate(*m.stage, m.L, m.T, m.V, o, nullptr, &cached).ok());
    o.kv_cache = false;
    ASSERT_TRUE(internal::Generate(*m.stage, m.L, m.T, m.V, o, nullptr, &full).ok());
    EXPECT_TRUE(cached.kv_cache) << preset;
    EXPECT_FALSE(full.kv_cache) << preset;
    EXPECT_EQ(cached.text.size(), static_cast<size_t>(o.tokens));
    EXPECT_EQ(cached.text, full.text) << preset;
  }
}

TEST(Generate, AModelWithALayerWithoutADecoderRecomputesTheWindow) {
  ModelBuilder b("delayed", {1, 16});
  b.Add("embed", layers::Embedding(256, 16, 8));
  b.Add("delay", layers::Delay(8, 0, 0, 0));  // no incremental decoding
  b.Add("lm_head", layers::LmHead(8, 256));
  b.Add("loss", layers::CrossEntropyLoss());
  LayerGraph graph = *b.Build();
  std::unique_ptr<Stage> stage = *graph.Instantiate(0, graph.num_layers(), 3);
  EXPECT_EQ(stage->layer(1).decoder(), nullptr);
  GenerateOptions o;
  o.tokens = 40;  // past the window: it slides by one
  o.temperature = 0;
  std::vector<size_t> sizes;
  GenerateResult r;
  ASSERT_TRUE(internal::Generate(*stage, 3, 16, 256, o, nullptr, &r,
                                 [&](const std::vector<int32_t>& w, const float*, int64_t) {
                                   sizes.push_back(w.size());
                                 })
                  .ok());
  EXPECT_FALSE(r.kv_cache);
  EXPECT_EQ(r.text.size(), 40u);
  EXPECT_EQ(sizes.back(), 16u);
  EXPECT_EQ(sizes[20], 16u);
}

TEST(IncrementalDecoding, EveryBuiltInLayerButTheLossHasADecoder) {
  for (const char* preset : {"gpt-tiny", "llama-tiny"}) {
    Model m = Noisy(preset, 13);
    for (int i = 0; i < m.L; ++i) {
      EXPECT_NE(m.stage->layer(i).decoder(), nullptr) << preset << " " << m.stage->name(i);
    }
    EXPECT_EQ(m.stage->layer(m.L).decoder(), nullptr) << "the loss";
  }
}

TEST(IncrementalDecoding, WhatDoesNotFitTheCacheIsRefusedAndLeavesItUnchanged) {
  Model m = Noisy("gpt-tiny", 14);
  const LayerContext ctx{};
  IncrementalDecoder* embed = m.stage->layer(0).decoder();
  IncrementalDecoder* block = m.stage->layer(1).decoder();
  DecodeCache ec, bc;
  EXPECT_EQ(embed->StartDecode(m.T + 1, ctx, &ec).code(), absl::StatusCode::kInvalidArgument)
      << "past the position table";
  EXPECT_EQ(embed->StartDecode(0, ctx, &ec).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(embed->StartDecode(4, ctx, &ec).ok());
  ASSERT_TRUE(block->StartDecode(4, ctx, &bc).ok());
  absl::StatusOr<Tensor> x = embed->Decode(Tensor::FromVectorI32({1, 3}, {1, 2, 3}), ctx, &ec);
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE(block->Decode(*x, ctx, &bc).ok());
  EXPECT_EQ(ec.length, 3);
  EXPECT_EQ(bc.length, 3);
  absl::StatusOr<Tensor> two = embed->Decode(Tensor::FromVectorI32({1, 2}, {4, 5}), ctx, &ec);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument) << "5 positions of 4";
  EXPECT_EQ(ec.length, 3);
  EXPECT_EQ(embed->Decode(Tensor::FromVectorI32({2, 1}, {4, 5}), ctx, &ec).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "two sequences";
  EXPECT_EQ(embed->Decode(Tensor::FromVectorI32({1, 1}, {256}), ctx, &ec).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "outside the vocabulary";
  EXPECT_EQ(block->Decode(Tensor::Zeros({1, 2, 64}), ctx, &bc).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bc.length, 3);
  EXPECT_EQ(ec.length, 3);
}

TEST(Generate, OptionsOutOfRangeAreRefusedNamingTheField) {
  Model m = Noisy("gpt-tiny", 15);
  GenerateResult r;
  GenerateOptions o;
  o.tokens = -1;
  absl::Status s = internal::Generate(*m.stage, m.L, m.T, m.V, o, nullptr, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("GenerateOptions.tokens"), absl::string_view::npos) << s;
  o = GenerateOptions{};
  o.temperature = -1;
  s = internal::Generate(*m.stage, m.L, m.T, m.V, o, nullptr, &r);
  EXPECT_NE(s.message().find("GenerateOptions.temperature"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace pipewright

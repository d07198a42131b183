// Helpers shared by the layer tests (built-in and custom layers).
#ifndef PIPEWRIGHT_TESTS_RUNTIME_LAYER_TEST_UTIL_H_
#define PIPEWRIGHT_TESTS_RUNTIME_LAYER_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "pipewright/model.h"
#include "pipewright/tensor.h"

namespace pipewright::testing_util {

// A host f32 tensor of N(0, std^2) values.
inline Tensor RandomTensor(std::vector<int64_t> shape, std::mt19937& rng, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  Tensor t = Tensor::Empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(rng);
  return t;
}

// Every parameter's values by global name.
inline std::map<std::string, std::vector<float>> ParamValues(Stage& s) {
  std::map<std::string, std::vector<float>> out;
  for (Parameter* p : s.Parameters()) out[p->name] = p->value.ToVector();
  return out;
}

// Instantiates `graph` whole and as every stage range [begin, end) with `seed`, and expects each
// parameter to have the same values in every range that holds it (initialisation independent of
// the stage). Returns the whole model's values (empty if it could not be instantiated).
inline std::map<std::string, std::vector<float>> ExpectSameParamsOnEveryStageRange(
    const LayerGraph& graph, uint64_t seed) {
  const int n = graph.num_layers();
  auto whole = graph.Instantiate(0, n, seed);
  EXPECT_TRUE(whole.ok()) << whole.status();
  if (!whole.ok()) return {};
  auto all = ParamValues(**whole);
  for (int begin = 0; begin < n; ++begin) {
    for (int end = begin + 1; end <= n; ++end) {
      auto part = graph.Instantiate(begin, end, seed);
      EXPECT_TRUE(part.ok()) << part.status();
      if (!part.ok()) continue;
      EXPECT_EQ((*part)->begin(), begin);
      for (const auto& [name, v] : ParamValues(**part)) {
        auto it = all.find(name);
        EXPECT_TRUE(it != all.end()) << name << " is not in the whole model";
        if (it == all.end()) continue;
        EXPECT_EQ(v, it->second) << name << " differs in stage [" << begin << ", " << end << ")";
      }
    }
  }
  return all;
}

}  // namespace pipewright::testing_util

#endif  // PIPEWRIGHT_TESTS_RUNTIME_LAYER_TEST_UTIL_H_

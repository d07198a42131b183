// The tied weights of a rank (runtime/engine/tied_weights.h): links within a rank, the ends of
// ties across ranks, and the reduction that leaves owner + copy in every tied gradient.
#include "runtime/engine/tied_weights.h"

#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

namespace pipewright::internal {
namespace {

Parameter Param(const std::string& name, const std::string& tied_to, std::vector<float> value,
                std::vector<float> grad) {
  Parameter p;
  p.name = name;
  p.tied_to = tied_to;
  const int64_t n = static_cast<int64_t>(value.size());
  p.value = Tensor::FromVector({n}, value);
  p.grad = Tensor::FromVector({n}, grad);
  return p;
}

TEST(TiedWeights, WithinARankTheCopySharesTheValueAndTheOwnerGetsBothGradients) {
  Parameter owner = Param("embed.wte.weight", "", {1, 2}, {1, 2});
  Parameter other = Param("blocks.0.w", "", {5, 6}, {0, 0});
  Parameter copy = Param("head.weight", "embed.wte.weight", {9, 9}, {10, 20});
  std::vector<Parameter*> trained;
  absl::StatusOr<TiedWeights> t = TiedWeights::Link({}, {&owner, &other, &copy}, &trained);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(trained, (std::vector<Parameter*>{&owner, &other}));
  EXPECT_EQ(copy.value.raw(), owner.value.raw()) << "the copy must share the owner's value";
  std::set<const Parameter*> tied;
  t->AddTo(&tied);
  EXPECT_EQ(tied, (std::set<const Parameter*>{&owner, &copy}));
  int waits = 0;
  ASSERT_TRUE(t->Reduce(nullptr, [&](Work& w, const std::string&) {
                 ++waits;
                 return w.Wait(absl::Seconds(30));
               }).ok());
  EXPECT_EQ(waits, 0) << "no collective for a tie within one rank";
  EXPECT_EQ(owner.grad.ToVector(), (std::vector<float>{11, 22}));
  EXPECT_EQ(copy.grad.ToVector(), (std::vector<float>{0, 0}));
  EXPECT_EQ(other.grad.ToVector(), (std::vector<float>{0, 0}));
}

TEST(TiedWeights, ShapesThatDifferAreRefusedByName) {
  Parameter owner = Param("embed.wte.weight", "", {1, 2}, {0, 0});
  Parameter copy = Param("head.weight", "embed.wte.weight", {1, 2, 3}, {0, 0, 0});
  std::vector<Parameter*> trained;
  absl::StatusOr<TiedWeights> t = TiedWeights::Link({}, {&owner, &copy}, &trained);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("head.weight is tied to embed.wte.weight"), std::string::npos)
      << t.status();
}

TEST(TiedWeights, TiePairsAreEachPairOnceLowerFirst) {
  const std::vector<CrossRankTie> ties = {{"a", 0, 3}, {"b", 3, 0}, {"c", 2, 1}};
  EXPECT_EQ(TiePairs(ties), (std::vector<std::pair<int, int>>{{0, 3}, {1, 2}}));
}

TEST(TiedWeights, AcrossRanksBothEndsHoldOwnerPlusCopy) {
  // pp 3: the first and last pipeline ranks share the table; the middle one holds neither end.
  const Topology topo{3, 1};
  const std::vector<CrossRankTie> ties = {{"embed.wte.weight", 0, 2}};
  GroupNeeds needs;
  needs.tie_pairs = TiePairs(ties);
  auto worlds = CreateLocalWorld(topo.world_size());
  std::vector<ProcessGroups> groups;
  for (auto& w : worlds) groups.emplace_back(std::move(w));
  std::vector<Parameter> params = {Param("embed.wte.weight", "", {1, 1}, {1, 2}),
                                   Param("blocks.0.w", "", {1, 1}, {7, 7}),
                                   Param("head.weight", "embed.wte.weight", {1, 1}, {30, 40})};
  std::vector<TiedWeights> t(3);
  std::vector<absl::Status> status(3);
  std::vector<std::thread> threads;
  for (int g = 0; g < 3; ++g) {
    threads.emplace_back([&, g] {
      status[g] = groups[g].Connect(topo, g, needs, absl::Seconds(30));
      if (status[g].ok()) status[g] = t[g].LinkRemote(g, ties, {&params[g]}, groups[g], "rank");
      if (status[g].ok()) {
        status[g] = t[g].Reduce(
            nullptr, [](Work& w, const std::string&) { return w.Wait(absl::Seconds(30)); });
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int g = 0; g < 3; ++g) ASSERT_TRUE(status[g].ok()) << "rank " << g << ": " << status[g];
  EXPECT_EQ(params[0].grad.ToVector(), (std::vector<float>{31, 42}));
  EXPECT_EQ(params[2].grad.ToVector(), (std::vector<float>{31, 42}));
  EXPECT_EQ(params[1].grad.ToVector(), (std::vector<float>{7, 7})) << "not an end of the tie";
}

TEST(TiedWeights, ARankWithoutItsEndIsAnInternalErrorNamingTheWeight) {
  auto worlds = CreateLocalWorld(1);
  ProcessGroups groups(std::move(worlds[0]));
  Parameter other = Param("blocks.0.w", "", {1}, {0});
  TiedWeights t;
  absl::Status s = t.LinkRemote(0, {{"embed.wte.weight", 0, 1}}, {&other}, groups, "rank 0");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("rank 0: holds no end of the tied weight embed.wte.weight"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace pipewright::internal

// The process groups of a rank (runtime/engine/process_groups.h): every group a pp x dp world
// needs, made by one collective Connect per rank, with the members and ranks the topology says.
#include "runtime/engine/process_groups.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "pipewright/comm.h"

namespace pipewright::internal {
namespace {

TEST(Topology, TensorRanksVaryFastestAndDefaultToOne) {
  const Topology two{2, 3};
  EXPECT_EQ(two.tp, 1);
  EXPECT_EQ(two.world_size(), 6);
  EXPECT_EQ(two.GlobalRank(1, 2), 5);  // replica-major, as before tensor parallelism
  const Topology t{2, 2, 2};
  EXPECT_EQ(t.world_size(), 8);
  for (int g = 0; g < 8; ++g) {
    EXPECT_EQ(t.GlobalRank(t.PipelineRank(g), t.Replica(g), t.TensorRank(g)), g);
  }
  EXPECT_EQ(t.TensorRank(1), 1);
  EXPECT_EQ(t.PipelineRank(2), 1);
  EXPECT_EQ(t.Replica(4), 1);
  EXPECT_EQ(t.DataParallelGroup(1, 1), (std::vector<int>{3, 7}));
}

TEST(ProcessGroups, EveryGroupHasTheTopologysMembers) {
  const Topology topo{3, 2};  // pp 3 x dp 2
  GroupNeeds needs;
  needs.tie_pairs = {{0, 2}};  // the first and last pipeline ranks share a weight
  needs.pipeline = true;
  auto worlds = CreateLocalWorld(topo.world_size());
  std::vector<ProcessGroups> groups;
  for (auto& w : worlds) groups.emplace_back(std::move(w));
  std::vector<absl::Status> status(groups.size());
  std::vector<std::thread> threads;
  for (int g = 0; g < topo.world_size(); ++g) {
    threads.emplace_back(
        [&, g] { status[g] = groups[g].Connect(topo, g, needs, absl::Seconds(30)); });
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < topo.world_size(); ++g) {
    ASSERT_TRUE(status[g].ok()) << status[g];
    const int pipe = topo.PipelineRank(g), replica = topo.Replica(g);
    ASSERT_NE(groups[g].data_parallel(), nullptr);
    EXPECT_EQ(groups[g].data_parallel()->size(), topo.dp);
    EXPECT_EQ(groups[g].data_parallel()->rank(), replica);
    ASSERT_NE(groups[g].pipeline(), nullptr);
    EXPECT_EQ(groups[g].pipeline()->size(), topo.pp);
    EXPECT_EQ(groups[g].pipeline()->rank(), pipe);
    if (pipe == 1) {
      EXPECT_EQ(groups[g].tie(0), nullptr) << "rank " << g << " holds no end of the tie";
    } else {
      ASSERT_NE(groups[g].tie(0), nullptr);
      EXPECT_EQ(groups[g].tie(0)->size(), 2);
      EXPECT_EQ(groups[g].tie(0)->rank(), pipe == 0 ? 0 : 1);
    }
    EXPECT_EQ(groups[g].tie(1), nullptr);
  }
  // The data-parallel groups connect the replicas of one pipeline rank: a sum over one.
  std::vector<Tensor> values;
  for (int g = 0; g < topo.world_size(); ++g) {
    values.push_back(Tensor::FromVector({1}, {static_cast<float>(g)}));
  }
  threads.clear();
  for (int g = 0; g < topo.world_size(); ++g) {
    threads.emplace_back([&, g] {
      status[g] = groups[g].data_parallel()->AllReduce(values[g])->Wait(absl::Seconds(30));
    });
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < topo.world_size(); ++g) {
    ASSERT_TRUE(status[g].ok()) << status[g];
    const int pipe = topo.PipelineRank(g);
    EXPECT_EQ(values[g].data<float>()[0],
              static_cast<float>(topo.GlobalRank(pipe, 0) + topo.GlobalRank(pipe, 1)));
  }
  for (auto& g : groups) g.ResetGroups();
}

TEST(ProcessGroups, OneReplicaNeedsNoDataParallelGroup) {
  auto worlds = CreateLocalWorld(2);
  std::vector<ProcessGroups> groups;
  for (auto& w : worlds) groups.emplace_back(std::move(w));
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(2);
  for (int g = 0; g < 2; ++g) {
    threads.emplace_back([&, g] {
      status[g] = groups[g].Connect(Topology{2, 1}, g, {}, absl::Seconds(30));
    });
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < 2; ++g) {
    ASSERT_TRUE(status[g].ok()) << status[g];
    EXPECT_EQ(groups[g].data_parallel(), nullptr);
    EXPECT_EQ(groups[g].pipeline(), nullptr) << "not asked for";
    EXPECT_NE(groups[g].world(), nullptr);
  }
  ProcessGroups none;
  EXPECT_FALSE(none.Connect(Topology{1, 1}, 0, {}, absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace pipewright::internal

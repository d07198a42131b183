// The rank's flight recorder (runtime/engine/flight_recorder.h): a ring of the last actions.
#include "runtime/engine/flight_recorder.h"

#include <gtest/gtest.h>

#include <string>

namespace pipewright::internal {
namespace {

TEST(FlightRecorder, KeepsTheLastActionsOldestFirst) {
  FlightRecorder f(3);
  EXPECT_TRUE(f.Snapshot().empty());
  for (int i = 0; i < 5; ++i) {
    f.Begin(i / 2, "A" + std::to_string(i), i);
    f.End(i + 0.5);
  }
  const auto s = f.Snapshot();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].action, "A2");
  EXPECT_EQ(s[1].action, "A3");
  EXPECT_EQ(s[2].action, "A4");
  EXPECT_EQ(s[2].step, 2);
  EXPECT_EQ(s[2].end_s, 4.5);
  EXPECT_EQ(f.count(), 5);
}

TEST(FlightRecorder, DescribesTheActionInProgressAndItsWait) {
  FlightRecorder f;
  f.Begin(7, "RECV_F3@s1", 1.0);
  f.Peer(2, 13, 4096);
  f.Waiting("RECV_F3@s1 from rank 2", 1.5);
  auto s = f.Snapshot();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].end_s, -1) << "still running";
  EXPECT_EQ(s[0].waiting_on, "RECV_F3@s1 from rank 2");
  EXPECT_EQ(s[0].wait_since_s, 1.5);
  EXPECT_EQ(s[0].peer, 2);
  EXPECT_EQ(s[0].tag, 13);
  EXPECT_EQ(s[0].bytes, 4096);
  f.DoneWaiting();
  f.End(2.0);
  s = f.Snapshot();
  EXPECT_EQ(s[0].wait_since_s, -1);
  EXPECT_EQ(s[0].waiting_on, "RECV_F3@s1 from rank 2") << "the last wait stays on record";
  EXPECT_EQ(s[0].end_s, 2.0);
}

}  // namespace
}  // namespace pipewright::internal

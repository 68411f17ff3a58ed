#include "daemon/node/delta_node.h"

#include <gtest/gtest.h>

namespace wb::daemon::node {
namespace {

TEST(ResolveDeltaThreads, AnExplicitCountIsKept) {
  EXPECT_EQ(ResolveDeltaThreads(1, 64), 1);
  EXPECT_EQ(ResolveDeltaThreads(5, 2), 5);
  EXPECT_EQ(ResolveDeltaThreads(40, 8), 40);
}

TEST(ResolveDeltaThreads, AutoIsHalfTheCpusBetweenTwoAndSixteen) {
  EXPECT_EQ(ResolveDeltaThreads(0, 0), 2);  // hardware_concurrency() may not know
  EXPECT_EQ(ResolveDeltaThreads(0, 2), 2);  // this VM: as before
  EXPECT_EQ(ResolveDeltaThreads(0, 5), 2);
  EXPECT_EQ(ResolveDeltaThreads(0, 16), 8);  // the device machine
  EXPECT_EQ(ResolveDeltaThreads(0, 32), 16);
  EXPECT_EQ(ResolveDeltaThreads(0, 224), 16);
}

}  // namespace
}  // namespace wb::daemon::node

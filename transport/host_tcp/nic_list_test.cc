#include "transport/host_tcp/nic_list.h"

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(ParseNicListTest, SplitsAndTrims) {
  auto n = ParseNicList(" 10.0.0.5, eth3 ,10.0.1.5");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, (std::vector<std::string>{"10.0.0.5", "eth3", "10.0.1.5"}));
}

TEST(ParseNicListTest, EmptyMeansSingleAddressMode) {
  auto n = ParseNicList("");
  ASSERT_TRUE(n.ok());
  EXPECT_TRUE(n->empty());
}

TEST(ParseNicListTest, RejectsEmptyItemsAndDuplicates) {
  EXPECT_EQ(ParseNicList("10.0.0.5,,10.0.1.5").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseNicList("10.0.0.5,").status().code(), absl::StatusCode::kInvalidArgument);
  auto dup = ParseNicList("eth2,eth2");
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("eth2 twice"), std::string::npos) << dup.status();
}

TEST(ResolveNicTest, LiteralsPassAndLoopbackResolves) {
  EXPECT_TRUE(IsIpv4Literal("127.0.0.2"));
  EXPECT_FALSE(IsIpv4Literal("lo"));
  EXPECT_FALSE(IsIpv4Literal("10.0.0"));
  auto a = ResolveNic("10.9.8.7");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, "10.9.8.7");
  auto lo = ResolveNic("lo");  // Linux loopback interface, always 127.0.0.1
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_EQ(*lo, "127.0.0.1");
}

TEST(ResolveNicTest, UnknownInterfaceIsNamed) {
  auto a = ResolveNic("no-such-nic0");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(a.status().message().find("no-such-nic0"), std::string::npos) << a.status();
  EXPECT_NE(a.status().message().find("lo"), std::string::npos) << a.status();  // lists what exists
}

}  // namespace
}  // namespace wb::transport

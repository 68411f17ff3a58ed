#include "transport/cpu_affinity.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(ParseCpuListTest, SinglesRangesAndWhitespace) {
  auto c = ParseCpuList("0-3,8, 10-11\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  c = ParseCpuList("5");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, std::vector<int>{5});
}

TEST(ParseCpuListTest, SortsAndDeduplicates) {
  auto c = ParseCpuList("7,2-4,3,7");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, (std::vector<int>{2, 3, 4, 7}));
}

TEST(ParseCpuListTest, RejectsBadInputNamingTheItem) {
  const std::vector<std::string> bads = {"", "  \n", "1,,2", "a", "1-", "-1", "3-1", "1-2-3", "+1", "0x1",
                                         std::to_string(CPU_SETSIZE)};
  for (const std::string& bad : bads) {
    auto c = ParseCpuList(bad);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << bad << "' parsed as " << (c.ok() ? FormatCpuList(*c) : "");
  }
  auto c = ParseCpuList("0,3-1");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'3-1'"), std::string::npos) << c.status();
}

TEST(FormatCpuListTest, CollapsesRuns) {
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({}), "");
  auto c = ParseCpuList(FormatCpuList({1, 4, 5, 6, 9}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<int>{1, 4, 5, 6, 9}));
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "/numaXXXXXX";
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(NumaNodeCpusTest, ReadsSysfsAndIntersectsWithAllowed) {
  auto allowed = AllowedCpus();
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  ASSERT_FALSE(allowed->empty());
  TempDir dir;
  std::filesystem::create_directories(dir.path() + "/node1");
  // Node 1 holds the first allowed CPU and one CPU this process may not use.
  const int first = allowed->front();
  {
    std::ofstream f(dir.path() + "/node1/cpulist");
    f << first << "," << CPU_SETSIZE - 1 << "\n";
  }
  auto c = NumaNodeCpus(1, dir.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, std::vector<int>{first});

  auto missing = NumaNodeCpus(7, dir.path());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();

  std::filesystem::create_directories(dir.path() + "/node2");
  {
    std::ofstream f(dir.path() + "/node2/cpulist");
    f << CPU_SETSIZE - 1 << "\n";
  }
  auto none = NumaNodeCpus(2, dir.path());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
}

TEST(ValidateCpuSetTest, RefusesEmptyAndUnavailable) {
  EXPECT_EQ(ValidateCpuSet({}).code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = ValidateCpuSet({0, CPU_SETSIZE - 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(std::to_string(CPU_SETSIZE - 1)), std::string::npos) << s;
  auto allowed = AllowedCpus();
  ASSERT_TRUE(allowed.ok());
  EXPECT_TRUE(ValidateCpuSet(*allowed).ok());
}

std::vector<int> AffinityOf(pthread_t t) {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(pthread_getaffinity_np(t, sizeof(set), &set), 0);
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

TEST(PinThreadTest, RestrictsTheThread) {
  auto allowed = AllowedCpus();
  ASSERT_TRUE(allowed.ok());
  const std::vector<int> one = {allowed->front()};
  absl::Notification go;
  std::thread t([&] { go.WaitForNotification(); });
  EXPECT_EQ(AffinityOf(t.native_handle()), *allowed);  // floats before pinning
  ASSERT_TRUE(PinThread(t, one).ok());
  EXPECT_EQ(AffinityOf(t.native_handle()), one);
  ASSERT_TRUE(PinThread(t, {}).ok());  // empty: no-op
  EXPECT_EQ(AffinityOf(t.native_handle()), one);
  go.Notify();
  t.join();
}

}  // namespace
}  // namespace wb::transport

#include "tests/e2e/harness.h"

#include <signal.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"

namespace wb::e2e {
namespace {

TEST(HarnessTest, CapturesEventsAndExitCode) {
  auto h = Harness::Create("harness");
  ASSERT_TRUE(h.ok()) << h.status();
  auto p = (*h)->Spawn("sh", {"/bin/sh", "-c",
                              "echo 'not json'; echo '{\"event\":\"applied\",\"version\":2}'; "
                              "echo oops >&2; exit 3"});
  ASSERT_TRUE(p.ok()) << p.status();
  auto ev = (*p)->WaitForEvent("applied", 2, absl::Seconds(10));
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ((*ev)["version"].get<int>(), 2);
  auto code = (*p)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 3);
  EXPECT_EQ((*p)->Events().size(), 1u);
  EXPECT_NE((*p)->LogTail().find("oops"), std::string::npos);
  // A line that never comes: the exit is reported instead of waiting out the deadline.
  absl::Time start = absl::Now();
  auto missing = (*p)->WaitForEvent("committed", 0, absl::Seconds(30));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A child that ends with a pipe full of lines: its exit is seen (reaper) before the reader has
// taken them all. Every line must be there once WaitExit returns - the e2e tests read a rollout's
// last events right after its exit.
TEST(HarnessTest, WaitExitReturnsOnlyOnceEveryLineIsRead) {
  auto h = Harness::Create("harness");
  ASSERT_TRUE(h.ok());
  constexpr int kLines = 200000;
  for (int round = 0; round < 5; ++round) {
    auto p = (*h)->Spawn("seq", {"/usr/bin/seq", "1", std::to_string(kLines)});
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->WaitExit(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
    const std::vector<std::string> lines = (*p)->Lines();
    ASSERT_EQ(lines.size(), static_cast<size_t>(kLines)) << "round " << round;
    EXPECT_EQ(lines.back(), std::to_string(kLines));
  }
}

// stdout held open by a process the child left behind: WaitExit says so at its deadline rather
// than returning with lines still to come.
TEST(HarnessTest, WaitExitNamesAStdoutHeldPastTheExit) {
  auto h = Harness::Create("harness");
  ASSERT_TRUE(h.ok());
  auto p = (*h)->Spawn("leaver", {"/bin/sh", "-c", "sleep 120 & echo $!; exit 0"});
  ASSERT_TRUE(p.ok());
  auto line = (*p)->WaitForLine([](const std::string&) { return true; }, absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  pid_t left = 0;
  ASSERT_TRUE(absl::SimpleAtoi(*line, &left)) << *line;
  // Generous: the shell only has to exit; the sleep holds stdout far longer.
  auto code = (*p)->WaitExit(absl::Seconds(10));
  EXPECT_EQ(code.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(code.status().message().find("stdout was still open"), std::string::npos) << code.status();
  ASSERT_EQ(::kill(left, SIGKILL), 0);  // the pipe closes: the reader (and ~Harness) can finish
  EXPECT_TRUE((*p)->WaitExit(absl::Seconds(30)).ok());
}

TEST(HarnessTest, KillAndDeadlines) {
  auto h = Harness::Create("harness");
  ASSERT_TRUE(h.ok());
  auto p = (*h)->Spawn("sleeper", {"/bin/sleep", "60"});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->WaitExit(absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*p)->WaitForEvent("x", 0, absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  (*p)->Signal(SIGTERM);
  auto code = (*p)->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, -SIGTERM);
}

TEST(HarnessTest, PortFileAndEarlyExit) {
  auto h = Harness::Create("harness");
  ASSERT_TRUE(h.ok());
  std::string port_file = (*h)->Path("port");
  auto writer = (*h)->Spawn("writer", {"/bin/sh", "-c", "sleep 0.2; echo 4242 > " + port_file});
  ASSERT_TRUE(writer.ok());
  auto port = (*h)->WaitForPortFile(port_file, absl::Seconds(10), *writer);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_EQ(*port, 4242);

  auto dies = (*h)->Spawn("dies", {"/bin/sh", "-c", "echo bad config >&2; exit 2"});
  ASSERT_TRUE(dies.ok());
  absl::Time start = absl::Now();
  auto none = (*h)->WaitForPortFile((*h)->Path("never"), absl::Seconds(30), *dies);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.status().message().find("bad config"), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(HarnessTest, DestructorKillsChildren) {
  pid_t pid;
  {
    auto h = Harness::Create("harness");
    ASSERT_TRUE(h.ok());
    auto p = (*h)->Spawn("sleeper", {"/bin/sleep", "60"});
    ASSERT_TRUE(p.ok());
    pid = (*p)->pid();
  }
  EXPECT_NE(::kill(pid, 0), 0);  // gone (and reaped)
}

TEST(HarnessTest, UnlinksSharedMemoryOfKilledChildren) {
  const std::string name = "/wb-harness-test-" + std::to_string(::getpid());
  {
    auto h = Harness::Create("harness");
    ASSERT_TRUE(h.ok());
    // On Linux a POSIX shm segment is a file in /dev/shm.
    auto p = (*h)->Spawn("holder", {"/bin/sh", "-c",
                                    "touch /dev/shm" + name + "; echo '{\"event\":\"ready\",\"shm\":\"" +
                                        name + "\"}'; exec sleep 60"});
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE((*p)->WaitForEvent("ready", 0, absl::Seconds(10)).ok());
    EXPECT_EQ(::access(("/dev/shm" + name).c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(("/dev/shm" + name).c_str(), F_OK), 0);
}

}  // namespace
}  // namespace wb::e2e

#include "base/socket_path.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace wb {
namespace {

// Binds a listening Unix socket at `path`; returns its fd.
int BindAt(const std::string& path) {
  EXPECT_LT(path.size(), sizeof(sockaddr_un::sun_path));
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ::unlink(path.c_str());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// (Under /tmp: bazel's TEST_TMPDIR is longer than a Unix socket path may be.)
std::string TempPath(const char* name) { return "/tmp/wbsock-" + std::to_string(::getpid()) + "-" + name; }

TEST(BoundSocketPathTest, RemovesItsOwnSocket) {
  const std::string path = TempPath("own.sock");
  int fd = BindAt(path);
  BoundSocketPath b = BoundSocketPath::Note(path);
  EXPECT_TRUE(b.UnlinkIfStillOurs());
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  ::close(fd);
}

// A second daemon bound the same path after the first (which unlinks a stale socket before its
// bind): the first one stopping leaves the second's socket alone.
TEST(BoundSocketPathTest, LeavesASocketAnotherOwnerBoundSince) {
  const std::string path = TempPath("shared.sock");
  int first = BindAt(path);
  BoundSocketPath b = BoundSocketPath::Note(path);
  int second = BindAt(path);  // unlinks the first's file, binds a new one
  EXPECT_FALSE(b.UnlinkIfStillOurs());
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "the second owner's socket was removed";
  BoundSocketPath b2 = BoundSocketPath::Note(path);
  EXPECT_TRUE(b2.UnlinkIfStillOurs());
  ::close(first);
  ::close(second);
}

TEST(BoundSocketPathTest, NothingRecordedNothingRemoved) {
  BoundSocketPath none;
  EXPECT_FALSE(none.UnlinkIfStillOurs());
  BoundSocketPath missing = BoundSocketPath::Note(TempPath("never-bound.sock"));
  EXPECT_FALSE(missing.UnlinkIfStillOurs());
}

// Before a bind: nothing there is fine; a socket nobody listens on (a killed daemon's) is removed;
// a socket a process listens on is refused and kept (a second daemon must not take a live one's
// workers); a file that is not a socket is refused and kept.
TEST(ClearStaleSocketTest, RemovesOnlyASocketNobodyListensOn) {
  const std::string path = TempPath("clear.sock");
  ::unlink(path.c_str());
  EXPECT_TRUE(ClearStaleSocket(path, SOCK_STREAM, "worker socket").ok());

  int live = BindAt(path);
  ASSERT_EQ(::listen(live, 4), 0);
  absl::Status s = ClearStaleSocket(path, SOCK_STREAM, "worker socket");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("worker socket path " + path + " is in use"), std::string::npos) << s;
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "a live socket was removed";
  ::close(live);  // its owner is gone: the file stays behind, stale

  EXPECT_TRUE(ClearStaleSocket(path, SOCK_STREAM, "worker socket").ok());
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "a stale socket was kept";

  const int f = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(f, 0);
  ::close(f);
  s = ClearStaleSocket(path, SOCK_STREAM, "worker socket");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("is not a socket"), std::string::npos) << s;
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "someone's file was removed";
  ::unlink(path.c_str());
}

// The fd channel is a SOCK_SEQPACKET socket: a live one is seen as live with its own type.
TEST(ClearStaleSocketTest, ALiveSeqpacketSocketIsRefused) {
  const std::string path = TempPath("clear.fd");
  ::unlink(path.c_str());
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  EXPECT_EQ(ClearStaleSocket(path, SOCK_SEQPACKET, "fd channel").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  ::close(fd);
  EXPECT_TRUE(ClearStaleSocket(path, SOCK_SEQPACKET, "fd channel").ok());
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

}  // namespace
}  // namespace wb

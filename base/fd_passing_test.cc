#include "base/fd_passing.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(FdPassingTest, DescriptorArrivesAndReadsTheSameFile) {
  int sp[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
  const int mfd = memfd_create("fd_passing_test", MFD_CLOEXEC);
  ASSERT_GE(mfd, 0);
  ASSERT_EQ(write(mfd, "hello", 5), 5);
  ASSERT_TRUE(SendWithFds(sp[0], "msg", {mfd}, absl::Now() + absl::Seconds(5)).ok());
  auto got = RecvWithFds(sp[1], 16, 1, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, "msg");
  ASSERT_EQ(got->fds.size(), 1u);
  EXPECT_NE(got->fds[0], mfd);
  char buf[5];
  ASSERT_EQ(pread(got->fds[0], buf, 5, 0), 5);
  EXPECT_EQ(std::string(buf, 5), "hello");
  EXPECT_EQ(fcntl(got->fds[0], F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  close(got->fds[0]);
  close(mfd);
  close(sp[0]);
  close(sp[1]);
}

TEST(FdPassingTest, TooManyDescriptorsOrBytesAreRefusedAndClosed) {
  int sp[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
  const int a = memfd_create("a", MFD_CLOEXEC), b = memfd_create("b", MFD_CLOEXEC);
  ASSERT_TRUE(SendWithFds(sp[0], "x", {a, b}, absl::Now() + absl::Seconds(5)).ok());
  auto got = RecvWithFds(sp[1], 16, 1, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  ASSERT_TRUE(SendWithFds(sp[0], std::string(100, 'y'), {}, absl::Now() + absl::Seconds(5)).ok());
  got = RecvWithFds(sp[1], 16, 1, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  close(a);
  close(b);
  close(sp[0]);
  close(sp[1]);
}

TEST(FdPassingTest, DeadlineAndClosedPeer) {
  int sp[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
  auto got = RecvWithFds(sp[1], 16, 1, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  close(sp[0]);
  got = RecvWithFds(sp[1], 16, 1, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kOutOfRange) << got.status();
  close(sp[1]);
}

TEST(FdPassingTest, OfferAndReplyEncodings) {
  VmmFdOffer o{"m", "trainer/0", "alloc-7", 4 << 20};
  auto back = DecodeVmmFdOffer(EncodeVmmFdOffer(o));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model_id, "m");
  EXPECT_EQ(back->worker_id, "trainer/0");
  EXPECT_EQ(back->key, "alloc-7");
  EXPECT_EQ(back->allocation_bytes, 4 << 20);
  EXPECT_EQ(back->allocation_id, 0u) << "none given: none on the wire (as a worker built before the field sends)";
  VmmFdOffer with = o;
  with.allocation_id = 0x1122334455667788ull;
  EXPECT_EQ(EncodeVmmFdOffer(with).size(), EncodeVmmFdOffer(o).size() + 8);
  back = DecodeVmmFdOffer(EncodeVmmFdOffer(with));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->allocation_id, 0x1122334455667788ull);
  EXPECT_EQ(back->key, "alloc-7");
  EXPECT_FALSE(DecodeVmmFdOffer(EncodeVmmFdOffer(o) + "xyz").ok()) << "a partial id is garbage";
  EXPECT_FALSE(DecodeVmmFdOffer(EncodeVmmFdOffer(o) + std::string(9, 'x')).ok()) << "bytes after the id";
  EXPECT_FALSE(DecodeVmmFdOffer("garbage").ok());
  o.key = "";
  EXPECT_FALSE(DecodeVmmFdOffer(EncodeVmmFdOffer(o)).ok());
  o.key = std::string(kMaxVmmKeyBytes + 1, 'k');
  EXPECT_FALSE(DecodeVmmFdOffer(EncodeVmmFdOffer(o)).ok());
  EXPECT_TRUE(DecodeFdReply(EncodeFdReply(absl::OkStatus())).ok());
  absl::Status refused = DecodeFdReply(EncodeFdReply(absl::PermissionDeniedError("not yours")));
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.message(), "not yours");
  EXPECT_EQ(DecodeFdReply("x").code(), absl::StatusCode::kInternal);
}

TEST(FdPassingTest, OfferToNobodyIsUnavailable) {
  const int mfd = memfd_create("x", MFD_CLOEXEC);
  absl::Status s = OfferVmmFd("/tmp/wb-no-such-fd-channel.sock", {"m", "w", "k", 1}, mfd, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  close(mfd);
}

}  // namespace
}  // namespace wb::transport

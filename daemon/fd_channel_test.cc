#include "daemon/fd_channel.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "base/fd_passing.h"

namespace wb::daemon {
namespace {

// Under /tmp: Bazel's TEST_TMPDIR is too long for a Unix socket path (108 bytes).
std::string TempPath(const char* name) { return absl::StrCat("/tmp/wb-fdc-", name, ".", getpid(), ".fd"); }

// A memfd holding `text` (stands in for an exported CUDA allocation: the channel never looks inside).
int MemfdWith(const std::string& text) {
  const int fd = memfd_create("fd_channel_test", MFD_CLOEXEC);
  if (fd >= 0 && write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) return -1;
  return fd;
}

std::string ReadAll(int fd) {
  char buf[64];
  const ssize_t n = pread(fd, buf, sizeof(buf), 0);
  return n > 0 ? std::string(buf, n) : "";
}

// Only this test process may send, and only for worker "w0" of model "m" (what the guarded worker
// service answers for a bound worker).
FdChannel::Authorize OnlyMe() {
  const pid_t me = getpid();
  return [me](const PeerCred& sender, const std::string& model, const std::string& worker) -> absl::Status {
    if (worker != "w0" || model != "m") return absl::NotFoundError(absl::StrCat("worker ", worker, " is not registered"));
    if (sender.pid != me) return absl::PermissionDeniedError(absl::StrCat("worker w0 belongs to process ", me));
    return absl::OkStatus();
  };
}

PeerCred Me() { return PeerCred{getpid(), getuid(), getgid(), ProcessStartTime(getpid())}; }

absl::Status Offer(const std::string& path, const std::string& worker, const std::string& key, int fd, const std::string& model = "m") {
  return transport::OfferVmmFd(path, {model, worker, key, 2 << 20}, fd, absl::Now() + absl::Seconds(10));
}

TEST(FdChannelTest, RegisteredWorkerSendsAndTheDaemonGetsTheSameFile) {
  auto c = FdChannel::Bind(TempPath("ok"), 0600, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  const int fd = MemfdWith("allocation zero");
  ASSERT_TRUE(Offer((*c)->path(), "w0", "alloc0", fd).ok());
  close(fd);  // the daemon keeps its own descriptor
  auto got = (*c)->Get("m", "w0", "alloc0", Me());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(ReadAll(got->fd), "allocation zero");
  EXPECT_EQ(got->allocation_bytes, 2 << 20);
  EXPECT_NE(got->cache_key.find(absl::StrCat(getpid())), std::string::npos) << got->cache_key;
  close(got->fd);
  // The same key again replaces the fd (one per allocation, however many buffers use it).
  const int fd2 = MemfdWith("allocation zero, new");
  ASSERT_TRUE(Offer((*c)->path(), "w0", "alloc0", fd2).ok());
  close(fd2);
  EXPECT_EQ((*c)->size(), 1u);
  got = (*c)->Get("m", "w0", "alloc0", Me());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(ReadAll(got->fd), "allocation zero, new");
  close(got->fd);
}

// The allocation id of an offer (VmmFdOffer::allocation_id) says whether a key offered again is the
// allocation of before (a client's replay: the same cache key, so the node keeps its mapping and a
// repeated RegisterLayout stays a replay) or another one (a new cache key: mapped anew). Offers
// without an id (workers built before the field) keep one cache key per key, as before.
TEST(FdChannelTest, AKeyOfferedWithAnotherAllocationIdGetsANewCacheKey) {
  auto c = FdChannel::Bind(TempPath("ids"), 0600, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  auto offer = [&](const std::string& key, uint64_t id, const std::string& text) {
    const int fd = MemfdWith(text);
    transport::VmmFdOffer o{"m", "w0", key, 2 << 20};
    o.allocation_id = id;
    absl::Status s = transport::OfferVmmFd((*c)->path(), o, fd, absl::Now() + absl::Seconds(10));
    close(fd);
    return s;
  };
  auto cache_key = [&](const std::string& key) -> std::string {
    auto got = (*c)->Get("m", "w0", key, Me());
    if (!got.ok()) return "";
    close(got->fd);
    return got->cache_key;
  };
  ASSERT_TRUE(offer("a", 7, "first").ok());
  const std::string first = cache_key("a");
  ASSERT_FALSE(first.empty());
  ASSERT_TRUE(offer("a", 7, "first, offered again").ok());  // a replay
  EXPECT_EQ(cache_key("a"), first);
  ASSERT_TRUE(offer("a", 8, "second").ok());  // another allocation under the key
  const std::string second = cache_key("a");
  EXPECT_NE(second, first);
  ASSERT_TRUE(offer("a", 7, "first id again").ok());  // not the first's mapping either: it was replaced
  EXPECT_NE(cache_key("a"), first);
  EXPECT_NE(cache_key("a"), second);
  // No id: one cache key per key while offers keep giving none.
  ASSERT_TRUE(offer("b", 0, "legacy").ok());
  const std::string legacy = cache_key("b");
  ASSERT_TRUE(offer("b", 0, "legacy again").ok());
  EXPECT_EQ(cache_key("b"), legacy);
  ASSERT_TRUE(offer("b", 3, "now with an id").ok());
  EXPECT_NE(cache_key("b"), legacy);
  EXPECT_EQ((*c)->size(), 2u);
}

TEST(FdChannelTest, UnknownKeyOrAnotherBoundProcessIsRefused) {
  auto c = FdChannel::Bind(TempPath("keys"), 0600, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  const int fd = MemfdWith("x");
  ASSERT_TRUE(Offer((*c)->path(), "w0", "alloc0", fd).ok());
  close(fd);
  auto unknown = (*c)->Get("m", "w0", "alloc1", Me());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_EQ((*c)->Get("m", "w1", "alloc0", Me()).status().code(), absl::StatusCode::kNotFound);
  PeerCred successor = Me();
  successor.pid += 1;  // the worker id is now bound to another process (a restart)
  auto stale = (*c)->Get("m", "w0", "alloc0", successor);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kPermissionDenied) << stale.status();
}

// The sender's identity is the kernel's (SO_PEERCRED): a forked child offering an fd for a worker
// bound to this process is refused with a clear error, and nothing is kept.
TEST(FdChannelTest, OfferFromAnotherProcessIsRefusedAndNothingKept) {
  auto c = FdChannel::Bind(TempPath("peer"), 0666, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string path = (*c)->path();
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(pipefd[0]);
    const int fd = MemfdWith("foreign");
    absl::Status s = Offer(path, "w0", "alloc0", fd);
    const std::string line = s.ToString();
    (void)!write(pipefd[1], line.data(), line.size());
    _exit(0);
  }
  close(pipefd[1]);
  std::string reply;
  char buf[512];
  for (ssize_t n; (n = read(pipefd[0], buf, sizeof(buf))) > 0;) reply.append(buf, n);
  close(pipefd[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_NE(reply.find("PERMISSION_DENIED"), std::string::npos) << reply;
  EXPECT_NE(reply.find(absl::StrCat("from pid ", child)), std::string::npos) << reply;
  EXPECT_EQ((*c)->size(), 0u);
  EXPECT_EQ((*c)->Get("m", "w0", "alloc0", Me()).status().code(), absl::StatusCode::kNotFound);
  // An unregistered worker id is refused too (the authorizer's NOT_FOUND).
  const int fd = MemfdWith("y");
  absl::Status s = Offer(path, "nobody", "alloc0", fd);
  close(fd);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ((*c)->size(), 0u);
}

// Issue 15.8: fds sent by a worker process that has exited are released (the next offer sweeps
// them), so dead workers cannot pin the node's fds.
TEST(FdChannelTest, FdsOfAnExitedProcessAreReleased) {
  auto anyone = [](const PeerCred&, const std::string& model, const std::string&) -> absl::Status {
    return model == "m" ? absl::OkStatus() : absl::NotFoundError("no such model");
  };
  auto c = FdChannel::Bind(TempPath("dead"), 0600, anyone);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string path = (*c)->path();
  const pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < 5; ++i) {
      const int fd = MemfdWith("child");
      if (!Offer(path, "wchild", absl::StrCat("alloc", i), fd).ok()) _exit(1);
      close(fd);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ((*c)->size(), 5u);
  const int fd = MemfdWith("mine");
  ASSERT_TRUE(Offer(path, "w0", "alloc0", fd).ok());
  close(fd);
  EXPECT_EQ((*c)->size(), 1u) << "the exited process's 5 fds are still held";
}

// Issue 15.8: a client that keeps its connection alive with refused offers (one every 0.4 s, each
// within the per-message deadline) must not hold up another worker's valid offer.
TEST(FdChannelTest, SlowRefusedClientDoesNotBlockAnotherOffer) {
  auto c = FdChannel::Bind(TempPath("slow"), 0600, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string path = (*c)->path();
  const int slow = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(connect(slow, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  auto refused_offer = [&] {
    const int fd = MemfdWith("refused");
    absl::Status s = transport::SendWithFds(slow, transport::EncodeVmmFdOffer({"m", "nobody", "k", 1 << 20}), {fd},
                                            absl::Now() + absl::Seconds(2));
    close(fd);
    if (!s.ok()) return s;
    auto reply = transport::RecvWithFds(slow, 8192, 0, absl::Now() + absl::Seconds(2));
    return reply.ok() ? transport::DecodeFdReply(reply->bytes) : reply.status();
  };
  ASSERT_EQ(refused_offer().code(), absl::StatusCode::kNotFound);
  std::atomic<bool> done{false};
  std::thread keep_alive([&] {
    for (int i = 0; i < 8 && !done.load(); ++i) {
      absl::SleepFor(absl::Milliseconds(400));  // a slow client, on purpose
      (void)refused_offer();
    }
  });
  const absl::Time t0 = absl::Now();
  const int fd = MemfdWith("valid");
  absl::Status s = transport::OfferVmmFd(path, {"m", "w0", "alloc0", 2 << 20}, fd, absl::Now() + absl::Seconds(1));
  close(fd);
  const absl::Duration took = absl::Now() - t0;
  done = true;
  keep_alive.join();
  close(slow);
  EXPECT_TRUE(s.ok()) << s << " after " << took;
  EXPECT_LT(took, absl::Seconds(1));
}

// Issue 15.8: a deregistered worker's fds are closed, and fds are bounded per uid and per node
// (here small limits), each refusal naming the limit.
TEST(FdChannelTest, DeregisterReleasesAndUidAndNodeBoundsHold) {
  auto any_worker = [me = getpid()](const PeerCred& sender, const std::string&, const std::string&) -> absl::Status {
    return sender.pid == me ? absl::OkStatus() : absl::PermissionDeniedError("not me");
  };
  FdChannelLimits limits;
  limits.per_worker = 3;
  limits.per_uid = 5;
  limits.total = 5;
  auto c = FdChannel::Bind(TempPath("bounds"), 0600, any_worker, limits);
  ASSERT_TRUE(c.ok()) << c.status();
  const int fd = MemfdWith("x");
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Offer((*c)->path(), "w0", absl::StrCat("k", i), fd).ok());
  absl::Status s = Offer((*c)->path(), "w0", "k3", fd);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("limit 3 per worker"), std::string::npos) << s;
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(Offer((*c)->path(), "w1", absl::StrCat("k", i), fd).ok());
  s = Offer((*c)->path(), "w1", "k2", fd);  // a third worker id of the same uid
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("limit 5 per uid"), std::string::npos) << s;
  EXPECT_EQ((*c)->ReleaseWorker("m", "w0"), 3u);
  EXPECT_EQ((*c)->size(), 2u);
  EXPECT_TRUE(Offer((*c)->path(), "w2", "k0", fd).ok()) << "room again after w0 deregistered";
  close(fd);
}

// Worker ids are scoped per model (docs/daemon.md "Model and worker rules"): one process serving
// two models, each with a `rollout/0` offering the same allocation key, keeps two fds; each model
// gets its own, a new offer for one replaces only that one, the per-worker bound counts per
// (model, worker), and deregistering one model's worker releases only its fds.
TEST(FdChannelTest, TwoModelsWithTheSameWorkerIdKeepTheirOwnFds) {
  auto any_worker = [me = getpid()](const PeerCred& sender, const std::string&, const std::string&) -> absl::Status {
    return sender.pid == me ? absl::OkStatus() : absl::PermissionDeniedError("not me");
  };
  FdChannelLimits limits;
  limits.per_worker = 2;
  auto c = FdChannel::Bind(TempPath("models"), 0600, any_worker, limits);
  ASSERT_TRUE(c.ok()) << c.status();
  const int a = MemfdWith("model a"), b = MemfdWith("model b");
  ASSERT_TRUE(Offer((*c)->path(), "rollout/0", "alloc0", a, "a").ok());
  ASSERT_TRUE(Offer((*c)->path(), "rollout/0", "alloc0", b, "b").ok());
  close(a);
  close(b);
  EXPECT_EQ((*c)->size(), 2u) << "the second model's offer must not replace the first's";
  auto got_a = (*c)->Get("a", "rollout/0", "alloc0", Me());
  auto got_b = (*c)->Get("b", "rollout/0", "alloc0", Me());
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  EXPECT_EQ(ReadAll(got_a->fd), "model a");
  EXPECT_EQ(ReadAll(got_b->fd), "model b");
  EXPECT_NE(got_a->cache_key, got_b->cache_key) << "the transport maps each model's allocation once, apart";
  close(got_a->fd);
  close(got_b->fd);
  auto none = (*c)->Get("c", "rollout/0", "alloc0", Me());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("of model c"), std::string::npos) << none.status();
  // The per-worker bound counts per (model, worker): model a's rollout/0 may add one more (2),
  // model b's too, however many the other holds.
  const int x = MemfdWith("x");
  ASSERT_TRUE(Offer((*c)->path(), "rollout/0", "alloc1", x, "a").ok());
  absl::Status s = Offer((*c)->path(), "rollout/0", "alloc2", x, "a");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("of model a"), std::string::npos) << s;
  ASSERT_TRUE(Offer((*c)->path(), "rollout/0", "alloc1", x, "b").ok());
  close(x);
  EXPECT_EQ((*c)->size(), 4u);
  // A new offer under model b's key replaces model b's fd only.
  const int b2 = MemfdWith("model b, new");
  ASSERT_TRUE(Offer((*c)->path(), "rollout/0", "alloc0", b2, "b").ok());
  close(b2);
  EXPECT_EQ((*c)->size(), 4u);
  got_a = (*c)->Get("a", "rollout/0", "alloc0", Me());
  ASSERT_TRUE(got_a.ok());
  EXPECT_EQ(ReadAll(got_a->fd), "model a");
  close(got_a->fd);
  // Deregistering model a's rollout/0 releases its two fds; model b's stay.
  EXPECT_EQ((*c)->ReleaseWorker("a", "rollout/0"), 2u);
  EXPECT_EQ((*c)->size(), 2u);
  EXPECT_EQ((*c)->Get("a", "rollout/0", "alloc0", Me()).status().code(), absl::StatusCode::kNotFound);
  got_b = (*c)->Get("b", "rollout/0", "alloc0", Me());
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  EXPECT_EQ(ReadAll(got_b->fd), "model b, new");
  close(got_b->fd);
}

TEST(FdChannelTest, GarbageAndFdLessOffersAreInvalidArgument) {
  auto c = FdChannel::Bind(TempPath("garbage"), 0600, OnlyMe());
  ASSERT_TRUE(c.ok()) << c.status();
  // An offer with a negative size is refused by the decoder.
  const int fd = MemfdWith("z");
  absl::Status s = transport::OfferVmmFd((*c)->path(), {"m", "w0", "k", -5}, fd, absl::Now() + absl::Seconds(10));
  close(fd);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ((*c)->size(), 0u);
  (*c)->Stop();
  EXPECT_EQ(access((*c)->path().c_str(), F_OK), -1) << "Stop unlinks the socket";
}

}  // namespace
}  // namespace wb::daemon

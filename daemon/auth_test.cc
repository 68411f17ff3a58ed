// Security fronts with real sockets and real processes: SO_PEERCRED identity on the worker socket
// (an impostor process is a re-exec of this binary, optionally dropping to uid 65534), shm
// ownership, request limits, and mutual TLS + token between daemons with throwaway certificates
// made by the openssl CLI. The real services are replaced by counting fakes: what is tested is
// what the fronts let through.
#include "daemon/auth.h"

#include <grpcpp/grpcpp.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/auth_gate.h"
#include "daemon/auth_policy.h"
#include "gtest/gtest.h"
#include "tests/e2e/harness.h"
#include "base/shm_segment.h"

namespace wb::daemon {
namespace {

class FakeWorkerService final : public pb::WorkerService::Service {
 public:
  std::atomic<int> calls{0};
  std::atomic<bool> fail_register{false};  // the node refuses registrations (e.g. not joined yet)
  grpc::Status RegisterWorker(grpc::ServerContext*, const pb::RegisterWorkerRequest* req, pb::RegisterWorkerResponse*) override {
    if (fail_register) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "node n0 is not registered with the coordinator yet");
    // A node's registration takes a while (it joins the worker at the coordinator): "slow*" ids do.
    if (req->worker_id().rfind("slow", 0) == 0) absl::SleepFor(absl::Milliseconds(300));
    return Ok();
  }
  grpc::Status RegisterLayout(grpc::ServerContext*, const pb::RegisterLayoutRequest*, pb::RegisterLayoutResponse*) override { return Ok(); }
  grpc::Status Publish(grpc::ServerContext*, const pb::PublishRequest*, pb::PublishResponse*) override { return Ok(); }
  grpc::Status Apply(grpc::ServerContext*, const pb::ApplyRequest*, pb::ApplyResponse*) override { return Ok(); }
  grpc::Status Deregister(grpc::ServerContext*, const pb::DeregisterRequest*, pb::DeregisterResponse*) override { return Ok(); }
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override { return Ok(); }

 private:
  grpc::Status Ok() {
    calls++;
    return grpc::Status::OK;
  }
};

class FakeNodeService final : public pb::NodeService::Service {
 public:
  std::atomic<int> calls{0};
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse* r) override {
    calls++;
    r->set_node_id("fake");
    return grpc::Status::OK;
  }
};

// ------------------------------------------------------------------ child process (impostor)
bool stub_channel_ready(const std::string& sock) {
  auto ch = grpc::CreateChannel("unix:" + sock, grpc::InsecureChannelCredentials());
  return ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// WB_AUTH_CHILD=<action> WB_SOCK=<path> WB_WORKER=<id> [WB_UID=<uid>] [WB_SHM=<name>]
// Exit code: the gRPC status code of the call (0 = OK), 100+ on setup failure.
int ChildMain() {
  const std::string action = std::getenv("WB_AUTH_CHILD");
  const std::string sock = std::getenv("WB_SOCK");
  const std::string worker = std::getenv("WB_WORKER") ? std::getenv("WB_WORKER") : "w";
  if (const char* uid = std::getenv("WB_UID")) {
    if (::setgid(static_cast<gid_t>(std::atoi(uid))) != 0 || ::setuid(static_cast<uid_t>(std::atoi(uid))) != 0) return 101;
  }
  auto stub = pb::WorkerService::NewStub(grpc::CreateChannel("unix:" + sock, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Status s;
  if (action == "publish") {
    pb::PublishRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(1);
    pb::PublishResponse resp;
    s = stub->Publish(&ctx, req, &resp);
  } else if (action == "register") {
    pb::RegisterWorkerRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    pb::RegisterWorkerResponse resp;
    s = stub->RegisterWorker(&ctx, req, &resp);
  } else if (action == "register_on_go") {
    // Connected, says so, then registers once a byte arrives on the fifo WB_GO (both racers at once).
    if (!stub_channel_ready(sock)) return 103;
    std::printf("ready\n");
    std::fflush(stdout);
    const int go = ::open(std::getenv("WB_GO"), O_RDONLY);
    char byte;
    if (go < 0 || ::read(go, &byte, 1) != 1) return 104;
    pb::RegisterWorkerRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    pb::RegisterWorkerResponse resp;
    s = stub->RegisterWorker(&ctx, req, &resp);
  } else if (action == "register_many") {
    // WB_COUNT workers <WB_WORKER>-0.. of model m, then exit without deregistering any.
    const int count = std::atoi(std::getenv("WB_COUNT"));
    for (int i = 0; i < count && s.ok(); ++i) {
      grpc::ClientContext c;
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      pb::RegisterWorkerRequest req;
      req.set_model_id("m");
      req.set_worker_id(absl::StrCat(worker, "-", i));
      pb::RegisterWorkerResponse resp;
      s = stub->RegisterWorker(&c, req, &resp);
    }
  } else if (action == "status") {
    pb::StatusResponse resp;
    s = stub->Status(&ctx, pb::StatusRequest(), &resp);
  } else {
    return 102;
  }
  std::fprintf(stderr, "child %s: %d %s\n", action.c_str(), static_cast<int>(s.error_code()), s.error_message().c_str());
  return static_cast<int>(s.error_code());
}

int RunChild(const std::vector<std::string>& env) {
  auto h = e2e::Harness::Create("auth");
  if (!h.ok()) return 200;
  auto p = (*h)->Spawn("child", {"/proc/self/exe"}, env);
  if (!p.ok()) return 201;
  auto code = (*p)->WaitExit(absl::Seconds(20));
  if (!code.ok()) return 202;
  if (*code != 0) std::fprintf(stderr, "%s\n", (*p)->LogTail().c_str());
  return *code;
}

// ------------------------------------------------------------------ worker socket
class WorkerFrontTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sock_ = absl::StrCat("/tmp/wbauth-", ::getpid(), ".sock");
    limits_.max_worker_bytes = 1 << 20;
    auto l = PeerCredListener::Bind(sock_, 0660);
    ASSERT_TRUE(l.ok()) << l.status();
    listener_ = std::move(*l);
    front_ = std::make_unique<WorkerGuard>(listener_.get(), limits_, "n0");
    gate_ = std::make_unique<AuthGate>(nullptr);
    front_->AddRules(*gate_);
    grpc::ServerBuilder b;
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(gate_->Interceptor());
    b.experimental().SetInterceptorCreators(std::move(interceptors));
    b.RegisterService(gate_->Guard<pb::WorkerService>(&fake_));
    server_ = b.BuildAndStart();
    ASSERT_TRUE(server_);
    listener_->Serve(server_.get());
    stub_ = pb::WorkerService::NewStub(grpc::CreateChannel("unix:" + sock_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    listener_->Stop();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  grpc::Status Register(const std::string& worker, const std::string& model = "m") {
    grpc::ClientContext ctx;
    pb::RegisterWorkerRequest req;
    req.set_model_id(model);
    req.set_worker_id(worker);
    pb::RegisterWorkerResponse resp;
    return stub_->RegisterWorker(&ctx, req, &resp);
  }
  grpc::Status Layout(const std::string& worker, const std::string& shm, uint64_t size) {
    grpc::ClientContext ctx;
    pb::RegisterLayoutRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    pb::BufferSpec* b = req.add_buffers();
    b->set_buffer_id(0);
    b->set_size_bytes(size);
    b->set_shm_name(shm);
    req.mutable_layout()->mutable_pieces();
    pb::RegisterLayoutResponse resp;
    return stub_->RegisterLayout(&ctx, req, &resp);
  }
  std::vector<std::string> ChildEnv(const std::string& action, const std::string& worker) {
    return {"WB_AUTH_CHILD=" + action, "WB_SOCK=" + sock_, "WB_WORKER=" + worker};
  }

  std::string sock_;
  Limits limits_;
  FakeWorkerService fake_;
  std::unique_ptr<PeerCredListener> listener_;
  std::unique_ptr<WorkerGuard> front_;
  std::unique_ptr<AuthGate> gate_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<pb::WorkerService::Stub> stub_;
};

TEST_F(WorkerFrontTest, SocketIsGroupOnly) {
  struct stat st {};
  ASSERT_EQ(::stat(sock_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
}

// A second daemon started on a live daemon's worker socket path is refused, naming the path (it
// used to remove the live socket and bind its own, taking the first daemon's workers away); a
// stale socket (nobody listens any more: a killed daemon's) is taken over. And a daemon stopping
// after another one bound the same path (a restart into the same directory while the old one was
// still stopping) left the new daemon without its socket file: it removes only the socket it bound.
TEST(PeerCredListenerTest, ALiveSocketIsRefusedAStaleOneTakenOverAndOnlyOursRemoved) {
  const std::string path = absl::StrCat("/tmp/wbauth-", ::getpid(), "-two.sock");
  auto first = PeerCredListener::Bind(path, 0660);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = PeerCredListener::Bind(path, 0660);
  ASSERT_FALSE(second.ok()) << "a second listener took over a live one's path";
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  for (const std::string& want : {path, std::string("is in use")}) {
    EXPECT_NE(second.status().message().find(want), std::string::npos) << want << " missing in: " << second.status();
  }
  // The first one's socket still takes connections.
  const int probe = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  EXPECT_EQ(::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  ::close(probe);
  // Another process replaced the file meanwhile (emulated: a socket bound there, not listening).
  ASSERT_EQ(::unlink(path.c_str()), 0);
  const int other = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_EQ(::bind(other, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  (*first)->Stop();
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "the first listener's Stop removed another's socket";
  // Nobody listens on that one: stale, taken over.
  auto third = PeerCredListener::Bind(path, 0660);
  ASSERT_TRUE(third.ok()) << third.status();
  (*third)->Stop();
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the third listener left its socket behind";
  ::close(other);
}

TEST_F(WorkerFrontTest, OwnerProcessMayActAnotherProcessMayNot) {
  ASSERT_TRUE(Register("w").ok());
  grpc::ClientContext ctx;
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("w");
  req.set_version(1);
  pb::PublishResponse resp;
  EXPECT_TRUE(stub_->Publish(&ctx, req, &resp).ok());
  const int before = fake_.calls;
  // Another process (same uid) can neither act as w nor take its id while we are alive.
  EXPECT_EQ(RunChild(ChildEnv("publish", "w")), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(RunChild(ChildEnv("register", "w")), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(fake_.calls, before) << "a refused call reached the service";
  // Nor act on another model with its own id: worker ids are scoped per model (issue 16.5), so
  // (other, w2) is simply not registered.
  ASSERT_TRUE(Register("w2", "m").ok());
  grpc::ClientContext ctx2;
  req.set_model_id("other");
  req.set_worker_id("w2");
  const int before2 = fake_.calls;
  grpc::Status s = stub_->Publish(&ctx2, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_NE(s.error_message().find("worker w2 of model 'other' is not registered"), std::string::npos) << s.error_message();
  EXPECT_EQ(fake_.calls, before2) << "a refused call reached the service";
}

TEST_F(WorkerFrontTest, DeadOwnersIdCanBeTakenOver) {
  // A child registers "ghost" and exits; its id is free for a restarted worker (this process).
  EXPECT_EQ(RunChild(ChildEnv("register", "ghost")), 0);
  EXPECT_TRUE(Register("ghost").ok());
}

// Workers whose processes exit without Deregister (kill -9, a crash, a client that never closes)
// leave their bindings behind; the node reaps the workers but nothing erased the bindings, so a
// stream of short-lived worker processes grew the table (and the daemon's memory, ~1 KiB a worker)
// without bound. They are swept once the table doubles; a live worker's binding stays.
TEST_F(WorkerFrontTest, BindingsOfExitedProcessesDoNotAccumulate) {
  ASSERT_TRUE(Register("live").ok());
  constexpr int kProcesses = 6, kEach = 100;
  for (int p = 0; p < kProcesses; ++p) {
    std::vector<std::string> env = ChildEnv("register_many", absl::StrCat("gone", p));
    env.push_back(absl::StrCat("WB_COUNT=", kEach));
    ASSERT_EQ(RunChild(env), 0) << "process " << p;
  }
  // 601 registered, 600 of them by processes that have exited: at most the last process's 100 and
  // the table's doubling headroom remain.
  EXPECT_LE(front_->bindings(), static_cast<size_t>(2 * kEach + 64)) << "bindings of exited processes accumulate";
  // The live worker kept its binding through every sweep: it may still act, another may not take it.
  grpc::ClientContext ctx;
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("live");
  req.set_version(1);
  pb::PublishResponse resp;
  EXPECT_TRUE(stub_->Publish(&ctx, req, &resp).ok());
  EXPECT_EQ(RunChild(ChildEnv("register", "live")), static_cast<int>(grpc::StatusCode::PERMISSION_DENIED));
}

// A worker whose process exited without Deregister keeps its binding until a sweep: a call naming
// it from another process is refused, saying that its owner has exited and how to take it over.
TEST_F(WorkerFrontTest, ARefusalNamesAnOwnerThatHasExited) {
  ASSERT_EQ(RunChild(ChildEnv("register", "orphan")), 0);
  grpc::ClientContext ctx;
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("orphan");
  req.set_version(1);
  pb::PublishResponse resp;
  grpc::Status s = stub_->Publish(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("which has exited (RegisterWorker takes the id over)"), std::string::npos) << s.error_message();
  // A live owner is named without it.
  ASSERT_TRUE(Register("mine").ok());
  EXPECT_EQ(RunChild(ChildEnv("publish", "mine")), static_cast<int>(grpc::StatusCode::PERMISSION_DENIED));
}

// A registration the node refuses gives the id it claimed back: to the exited process it was taken
// from, or to nobody; the next one that succeeds holds it.
TEST_F(WorkerFrontTest, AFailedRegistrationGivesItsClaimBack) {
  auto publish = [&](const std::string& worker) {
    grpc::ClientContext ctx;
    pb::PublishRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(1);
    pb::PublishResponse resp;
    return stub_->Publish(&ctx, req, &resp);
  };
  ASSERT_EQ(RunChild(ChildEnv("register", "held")), 0);  // held by a process that has exited
  const size_t before = front_->bindings();
  fake_.fail_register = true;
  EXPECT_EQ(Register("held").error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Register("fresh").error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(front_->bindings(), before);
  grpc::Status s = publish("held");  // back with the exited process, not with this one
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("which has exited"), std::string::npos) << s.error_message();
  EXPECT_EQ(publish("fresh").error_code(), grpc::StatusCode::NOT_FOUND);
  fake_.fail_register = false;
  ASSERT_TRUE(Register("held").ok());
  EXPECT_TRUE(publish("held").ok());
}

// Two live processes registering the same worker id at the same moment: before, both passed the
// check (the binding was recorded only once a registration succeeded) and both got OK, the later
// binding winning. Now the first claims the id when its call is checked; the other is refused.
TEST_F(WorkerFrontTest, TwoProcessesRegisteringOneIdAtOnceDoNotBothGetIt) {
  const std::string go = absl::StrCat("/tmp/wbauth-go-", ::getpid());
  ::unlink(go.c_str());
  ASSERT_EQ(::mkfifo(go.c_str(), 0600), 0);
  // Held open for writing throughout, so a racer's open for reading never waits for a writer.
  const int fd = ::open(go.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto h = e2e::Harness::Create("auth_race");
  ASSERT_TRUE(h.ok()) << h.status();
  std::vector<e2e::Process*> racers;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> env = ChildEnv("register_on_go", "slow-r0");
    env.push_back("WB_GO=" + go);
    auto p = (*h)->Spawn(absl::StrCat("racer", i), {"/proc/self/exe"}, env);
    ASSERT_TRUE(p.ok()) << p.status();
    racers.push_back(*p);
  }
  for (e2e::Process* p : racers) {
    ASSERT_TRUE(p->WaitForLine([](const std::string& l) { return l == "ready"; }, absl::Seconds(20)).ok()) << p->LogTail();
  }
  ASSERT_EQ(::write(fd, "gg", 2), 2);  // one byte each: both register at once
  std::vector<int> codes;
  for (e2e::Process* p : racers) {
    auto code = p->WaitExit(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    codes.push_back(*code);
  }
  ::close(fd);
  ::unlink(go.c_str());
  std::sort(codes.begin(), codes.end());
  EXPECT_EQ(codes, (std::vector<int>{0, static_cast<int>(grpc::StatusCode::PERMISSION_DENIED)}))
      << "both processes were told they hold worker slow-r0";
}

TEST_F(WorkerFrontTest, OtherUidCannotConnect) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to switch to an unprivileged uid";
  std::vector<std::string> env = ChildEnv("status", "w");
  env.push_back("WB_UID=65534");
  EXPECT_EQ(RunChild(env), grpc::StatusCode::UNAVAILABLE);  // connect(): EACCES on a 0660 root socket
}

TEST_F(WorkerFrontTest, ShmMustBeOwnedByTheCallerAndLargeEnough) {
  ASSERT_TRUE(Register("w").ok());
  auto mine = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("authm"), 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE(Layout("w", mine->name(), 4096).ok());
  grpc::Status big = Layout("w", mine->name(), 8192);
  EXPECT_EQ(big.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << big.error_message();
  grpc::Status huge = Layout("w", mine->name(), uint64_t{1} << 50);
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << huge.error_message();
  EXPECT_EQ(Layout("w", "/no-such-segment-wb", 64).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Layout("w", "../etc/passwd", 64).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  if (::getuid() == 0) {
    auto theirs = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("autht"), 4096);
    ASSERT_TRUE(theirs.ok());
    ASSERT_EQ(::chown(("/dev/shm" + theirs->name()).c_str(), 65534, 65534), 0);
    grpc::Status s = Layout("w", theirs->name(), 4096);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("owned by uid 65534"), std::string::npos) << s.error_message();
  }
}

TEST_F(WorkerFrontTest, ConcurrentVersionsAreBounded) {
  TearDown();
  limits_.max_concurrent_versions = 2;
  SetUp();
  ASSERT_TRUE(Register("t").ok());
  auto publish = [&](uint64_t v) {
    grpc::ClientContext ctx;
    pb::PublishRequest req;
    req.set_model_id("m");
    req.set_worker_id("t");
    req.set_version(v);
    pb::PublishResponse resp;
    return stub_->Publish(&ctx, req, &resp);
  };
  EXPECT_TRUE(publish(1).ok());
  EXPECT_TRUE(publish(2).ok());
  grpc::Status s = publish(3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  front_->NoteCommitted("m", 1);  // version 1 done: room for one more
  EXPECT_TRUE(publish(3).ok());
  front_->NoteAborted("m", 2);
  EXPECT_TRUE(publish(4).ok());
  EXPECT_EQ(publish(5).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST_F(WorkerFrontTest, OversizedModelSpecRefusedBeforeTheService) {
  grpc::ClientContext ctx;
  pb::RegisterWorkerRequest req;
  req.set_model_id("m");
  req.set_worker_id("w");
  pb::TensorSpec* t = req.mutable_model()->mutable_explicit_tensors()->add_tensors();
  t->set_name("x");
  t->add_shape(int64_t{1} << 62);
  t->add_shape(int64_t{1} << 62);
  pb::RegisterWorkerResponse resp;
  const int before = fake_.calls;
  grpc::Status s = stub_->RegisterWorker(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(fake_.calls, before);
}

// ------------------------------------------------------------------ daemon <-> daemon
std::string Sh(const std::string& dir, const std::string& cmd) {
  std::string full = absl::StrCat("cd ", dir, " && (", cmd, ") >>openssl.log 2>&1");
  return std::system(full.c_str()) == 0 ? "" : "failed: " + cmd;
}

// CA, a node certificate (SAN 127.0.0.1/localhost, server+client auth) and a rogue self-signed one.
std::string MakeCerts(const std::string& dir) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  for (const std::string& cmd : {
           absl::StrCat("openssl req -x509 ", ec, " -keyout ca.key -out ca.pem -days 1 -subj /CN=wb-test-ca"),
           absl::StrCat("openssl req ", ec, " -keyout node.key -out node.csr -subj /CN=localhost"),
           std::string("printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' > ext.cnf"),
           std::string("openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem -days 1 -extfile ext.cnf"),
           absl::StrCat("openssl req -x509 ", ec, " -keyout rogue.key -out rogue.pem -days 1 -subj /CN=localhost -addext "
                        "subjectAltName=IP:127.0.0.1"),
           std::string("printf 's3cret-token\n' > token; printf 'wrong-token' > wrong"),
       }) {
    std::string e = Sh(dir, cmd);
    if (!e.empty()) return e;
  }
  return "";
}

class PeerAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/certs";
    ASSERT_EQ(std::system(("mkdir -p " + dir_).c_str()), 0) << "mkdir " << dir_;
    std::string err = MakeCerts(dir_);
    ASSERT_EQ(err, "");
  }
  std::string P(const std::string& f) { return dir_ + "/" + f; }
  PeerAuthConfig Load(bool tls, const std::string& token_file, const std::string& cert = "node") {
    auto c = LoadPeerAuth(tls ? P(cert + ".pem") : "", tls ? P(cert + ".key") : "", tls ? P("ca.pem") : "",
                          token_file.empty() ? "" : P(token_file));
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }
  // Starts a fake NodeService behind the token/TLS front; returns its port.
  int Serve(const PeerAuthConfig& config) {
    front_ = std::make_unique<AuthGate>(nullptr);
    AddNodeRules(*front_, PeerRuleOptions{.config = std::make_shared<PeerAuthConfig>(config)}, nullptr, nullptr);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", MakeServerCredentials(config), &port);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(front_->Interceptor());
    b.experimental().SetInterceptorCreators(std::move(interceptors));
    b.RegisterService(front_->Guard<pb::NodeService>(&fake_));
    server_ = b.BuildAndStart();
    return port;
  }
  grpc::StatusCode Call(int port, std::shared_ptr<grpc::Channel> ch) {
    (void)port;
    auto stub = pb::NodeService::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    pb::StatusResponse resp;
    grpc::Status s = stub->Status(&ctx, pb::StatusRequest(), &resp);
    last_error_ = s.error_message();
    return s.error_code();
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  std::string dir_, last_error_;
  FakeNodeService fake_;
  std::unique_ptr<AuthGate> front_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(PeerAuthTest, MutualTlsPlusToken) {
  PeerAuthConfig server = Load(true, "token");
  const int port = Serve(server);
  ASSERT_GT(port, 0);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  EXPECT_EQ(Call(port, MakePeerChannel(addr, server)), grpc::StatusCode::OK) << last_error_;
  EXPECT_EQ(fake_.calls, 1);
  // TLS ok, no token / wrong token.
  EXPECT_EQ(Call(port, MakePeerChannel(addr, Load(true, ""))), grpc::StatusCode::UNAUTHENTICATED) << last_error_;
  EXPECT_EQ(Call(port, MakePeerChannel(addr, Load(true, "wrong"))), grpc::StatusCode::UNAUTHENTICATED) << last_error_;
  // Right token, but no client certificate.
  {
    PeerAuthConfig no_cert = server;
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = server.tls_ca_pem;
    auto ch = grpc::experimental::CreateCustomChannelWithInterceptors(addr, grpc::SslCredentials(o), grpc::ChannelArguments(), {});
    EXPECT_EQ(Call(port, ch), grpc::StatusCode::UNAUTHENTICATED) << last_error_;
  }
  // A certificate from another CA never gets past the handshake; nor does plaintext.
  EXPECT_EQ(Call(port, MakePeerChannel(addr, Load(true, "token", "rogue"))), grpc::StatusCode::UNAVAILABLE) << last_error_;
  EXPECT_EQ(Call(port, grpc::CreateChannel(addr, grpc::InsecureChannelCredentials())), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(fake_.calls, 1) << "a refused peer reached the service";
}

TEST_F(PeerAuthTest, TokenWithoutTls) {
  PeerAuthConfig server = Load(false, "token");
  const int port = Serve(server);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  EXPECT_EQ(Call(port, MakePeerChannel(addr, server)), grpc::StatusCode::OK) << last_error_;
  EXPECT_EQ(Call(port, grpc::CreateChannel(addr, grpc::InsecureChannelCredentials())), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(port, MakePeerChannel(addr, Load(false, "wrong"))), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(fake_.calls, 1);
}

TEST_F(PeerAuthTest, BadConfigurationsAreInvalidArgument) {
  EXPECT_EQ(LoadPeerAuth(P("node.pem"), "", P("ca.pem"), "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadPeerAuth("", "", "", P("missing")).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadPeerAuth(P("token"), P("node.key"), P("ca.pem"), "").status().code(), absl::StatusCode::kInvalidArgument);
  Sh(dir_, "printf '  \n' > empty");
  EXPECT_EQ(LoadPeerAuth("", "", "", P("empty")).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wb::daemon

int main(int argc, char** argv) {
  if (std::getenv("WB_AUTH_CHILD")) return wb::daemon::ChildMain();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

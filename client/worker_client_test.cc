// Unit tests of the worker client against an in-process fake WorkerService on a temporary Unix
// socket (a fake isolates the client; the real daemon is exercised by tests/e2e/).
#include "client/worker_client.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "daemon/fd_channel.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "base/fd_passing.h"
#include "base/shm_segment.h"

namespace wb::client {
namespace {

using ::testing::HasSubstr;

// Records every request; answers from programmable statuses.
class FakeWorkerService final : public pb::WorkerService::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const pb::RegisterWorkerRequest* req,
                              pb::RegisterWorkerResponse* resp) override {
    absl::MutexLock l(&mu_);
    register_worker_.push_back(*req);
    resp->set_session("s1");
    return ToGrpcStatus(register_worker_status_);
  }
  grpc::Status RegisterLayout(grpc::ServerContext*, const pb::RegisterLayoutRequest* req,
                              pb::RegisterLayoutResponse* resp) override {
    absl::MutexLock l(&mu_);
    register_layout_.push_back(*req);
    if (!register_layout_status_.ok()) return ToGrpcStatus(register_layout_status_);
    resp->set_num_pieces(req->layout().has_pieces() ? req->layout().pieces().pieces_size() : 7);
    resp->set_bytes(1234);
    return grpc::Status::OK;
  }
  grpc::Status Publish(grpc::ServerContext*, const pb::PublishRequest* req,
                       pb::PublishResponse* resp) override {
    absl::MutexLock l(&mu_);
    publish_.push_back(*req);
    if (publish_busy_ > 0) {
      // What gRPC's sync server answers when its thread quota is spent (the handler never runs).
      --publish_busy_;
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Server Threadpool Exhausted");
    }
    resp->set_version(req->version());
    resp->set_stall_seconds(0.25);
    return ToGrpcStatus(publish_status_);
  }
  grpc::Status BeginUpdate(grpc::ServerContext*, const pb::BeginUpdateRequest* req,
                           pb::BeginUpdateResponse*) override {
    absl::MutexLock l(&mu_);
    begin_update_.push_back(*req);
    return grpc::Status::OK;
  }
  grpc::Status EndUpdate(grpc::ServerContext*, const pb::EndUpdateRequest* req,
                         pb::EndUpdateResponse* resp) override {
    absl::MutexLock l(&mu_);
    end_update_.push_back(*req);
    resp->set_applied_version(4);
    resp->set_committed_version(5);
    return ToGrpcStatus(end_update_status_);
  }
  grpc::Status Apply(grpc::ServerContext*, const pb::ApplyRequest* req,
                     pb::ApplyResponse* resp) override {
    absl::MutexLock l(&mu_);
    resp->set_applied_version(req->version() == 0 ? 9 : req->version());
    return grpc::Status::OK;
  }
  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest* req,
                           pb::WaitVersionResponse* resp) override {
    absl::MutexLock l(&mu_);
    if (req->version() == 13) {
      return ToGrpcStatus(absl::AbortedError("version 13 aborted: node n2 lost its lease"));
    }
    resp->set_committed_version(req->version());
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const pb::DeregisterRequest* req,
                          pb::DeregisterResponse*) override {
    absl::MutexLock l(&mu_);
    deregister_.push_back(*req);
    return grpc::Status::OK;
  }
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*,
                      pb::StatusResponse* resp) override {
    auto* w = resp->add_workers();
    w->set_worker_id("trainer/0");
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  absl::Status register_worker_status_ ABSL_GUARDED_BY(mu_);
  absl::Status register_layout_status_ ABSL_GUARDED_BY(mu_);
  absl::Status publish_status_ ABSL_GUARDED_BY(mu_);
  int publish_busy_ ABSL_GUARDED_BY(mu_) = 0;  // Publish calls answered "Server Threadpool Exhausted"
  std::vector<pb::RegisterWorkerRequest> register_worker_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::RegisterLayoutRequest> register_layout_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::PublishRequest> publish_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::BeginUpdateRequest> begin_update_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::EndUpdateRequest> end_update_ ABSL_GUARDED_BY(mu_);
  absl::Status end_update_status_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::DeregisterRequest> deregister_ ABSL_GUARDED_BY(mu_);
};

class FakeDaemon {
 public:
  explicit FakeDaemon(const std::string& path) : path_(path) {
    ::unlink(path.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", path), grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeDaemon() { Stop(); }
  void Stop() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now());
      server_->Wait();
      server_.reset();
      ::unlink(path_.c_str());
    }
  }
  bool running() const { return server_ != nullptr; }
  FakeWorkerService& service() { return service_; }

 private:
  std::string path_;
  FakeWorkerService service_;
  std::unique_ptr<grpc::Server> server_;
};

// Unix socket paths are limited to 107 bytes, and Bazel's TEST_TMPDIR is longer than that: a
// short private dir under /tmp, removed when the test binary exits.
const std::string& SocketDir() {
  static const std::string* dir = [] {
    char tmpl[] = "/tmp/wb-wctest-XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    auto* d = new std::string(made ? made : "/tmp");
    if (made != nullptr) std::atexit([] { std::filesystem::remove_all(SocketDir()); });
    return d;
  }();
  return *dir;
}

std::string TempSocket(const std::string& tag) { return absl::StrCat(SocketDir(), "/", tag, ".sock"); }

ModelConfig TinyModel() {
  ModelConfig m;
  m.model_id = "tiny";
  m.explicit_inventory.tensors.push_back({"w", {4, 8}, planner::DType::kBF16});
  m.num_trainer_workers = 1;
  m.num_rollout_workers = 1;
  m.mode = Mode::kOneStepOff;
  return m;
}

ClientOptions FastOptions() {
  ClientOptions o;
  o.call_timeout = absl::Seconds(5);
  o.connect_timeout = absl::Seconds(5);
  o.reconnect_timeout = absl::Seconds(5);
  o.shm_prefix = "wctest";
  return o;
}

TEST(WorkerClientTest, ConnectFailsWithinDeadlineWhenNoDaemon) {
  ClientOptions o = FastOptions();
  o.connect_timeout = absl::Milliseconds(300);
  absl::Time start = absl::Now();
  auto client = WorkerClient::Connect(TempSocket("nobody"), o);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(WorkerClientTest, RegistersWorkerBuffersAndLayout) {
  std::string sock = TempSocket("reg");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  auto buf = c.CreateBuffer(64);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ((*buf)->id, 0u);
  static_cast<char*>((*buf)->data)[5] = 42;

  planner::Piece piece;
  piece.tensor = 0;
  piece.box = {{0, 0}, {4, 8}};
  piece.buffer = 0;
  piece.strides = {8, 1};
  auto pieces = PiecesToProto({piece}, TinyModel().explicit_inventory);
  ASSERT_TRUE(pieces.ok());
  ExplicitLayout layout;
  layout.pieces.assign(pieces->pieces().begin(), pieces->pieces().end());
  auto info = c.RegisterLayout(layout);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->num_pieces, 1u);

  absl::MutexLock l(&daemon.service().mu_);
  ASSERT_EQ(daemon.service().register_worker_.size(), 1u);
  const auto& rw = daemon.service().register_worker_[0];
  EXPECT_EQ(rw.model_id(), "tiny");
  EXPECT_EQ(rw.role(), pb::ROLE_TRAINER);
  EXPECT_EQ(rw.model().mode(), pb::MODE_ONE_STEP_OFF);
  ASSERT_EQ(rw.model().explicit_tensors().tensors_size(), 1);
  EXPECT_EQ(rw.model().explicit_tensors().tensors(0).name(), "w");

  ASSERT_EQ(daemon.service().register_layout_.size(), 1u);
  const auto& rl = daemon.service().register_layout_[0];
  ASSERT_EQ(rl.buffers_size(), 1);
  EXPECT_EQ(rl.buffers(0).size_bytes(), 64u);
  EXPECT_EQ(rl.layout().pieces().pieces(0).tensor(), "w");
  EXPECT_EQ(rl.layout().pieces().pieces(0).box().end(1), 8);
  // The daemon can map the named segment and sees the worker's bytes.
  auto seg = transport::ShmSegment::Open(rl.buffers(0).shm_name(), 64);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(static_cast<char*>(seg->data())[5], 42);
}

TEST(WorkerClientTest, CudaBuffersAreSentByHandleNextToShmBuffers) {
  std::string sock = TempSocket("cuda");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 1}).ok());
  // Bad handles and sizes are refused before anything is remembered.
  EXPECT_EQ(c.AddCudaBuffer(std::string(63, 'h'), 64, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaBuffer(std::string(64, 'h'), 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaBuffer(std::string(64, 'h'), 64, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaBuffer(std::string(64, 'h'), 64, 1, std::string(15, 'u')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.buffers().empty());
  auto host = c.CreateBuffer(32);
  ASSERT_TRUE(host.ok()) << host.status();
  std::string handle(64, '\0');
  for (int i = 0; i < 64; ++i) handle[i] = static_cast<char>(i * 7);
  auto dev = c.AddCudaBuffer(handle, 64, 1, std::string(16, 'u'));
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->id, 1u);
  EXPECT_EQ((*dev)->data, nullptr);

  planner::Piece piece;
  piece.tensor = 0;
  piece.box = {{0, 0}, {4, 8}};
  piece.buffer = 1;
  piece.strides = {8, 1};
  auto pieces = PiecesToProto({piece}, TinyModel().explicit_inventory);
  ASSERT_TRUE(pieces.ok());
  ExplicitLayout layout;
  layout.pieces.assign(pieces->pieces().begin(), pieces->pieces().end());
  ASSERT_TRUE(c.RegisterLayout(layout).ok());
  absl::MutexLock l(&daemon.service().mu_);
  ASSERT_EQ(daemon.service().register_layout_.size(), 1u);
  const auto& rl = daemon.service().register_layout_[0];
  ASSERT_EQ(rl.buffers_size(), 2);
  EXPECT_EQ(rl.buffers(0).memory_case(), pb::BufferSpec::kShmName);
  EXPECT_EQ(rl.buffers(0).gpu(), -1);
  EXPECT_EQ(rl.buffers(1).memory_case(), pb::BufferSpec::kCudaIpcHandle);
  EXPECT_EQ(rl.buffers(1).cuda_ipc_handle(), handle);
  EXPECT_EQ(rl.buffers(1).size_bytes(), 64u);
  EXPECT_EQ(rl.buffers(1).gpu(), 1);
  EXPECT_EQ(rl.buffers(1).buffer_id(), 1u);
}

TEST(WorkerClientTest, PresetLayoutIsSentByName) {
  std::string sock = TempSocket("preset");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"rollout/0", planner::Role::kRollout, -1}).ok());
  ASSERT_TRUE((*client)->CreateBuffer(128).ok());
  PresetLayout preset;
  preset.preset = "sglang";
  preset.tp = 2;
  preset.dp = 2;
  preset.rank = 1;
  preset.enable_dp_lm_head = true;
  preset.moe_dense_tp_size = 1;
  ASSERT_TRUE((*client)->RegisterLayout(preset).ok());
  absl::MutexLock l(&daemon.service().mu_);
  const auto& pc = daemon.service().register_layout_.back().layout().preset();
  EXPECT_EQ(pc.preset(), "sglang");
  EXPECT_EQ(pc.tp(), 2u);
  EXPECT_EQ(pc.dp(), 2u);
  EXPECT_EQ(pc.rank(), 1u);
  EXPECT_TRUE(pc.enable_dp_lm_head());
  EXPECT_EQ(pc.moe_dense_tp_size(), 1u);
}

TEST(WorkerClientTest, DaemonErrorsKeepTheirCodeAndNothingIsRemembered) {
  std::string sock = TempSocket("err");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  {
    absl::MutexLock l(&daemon.service().mu_);
    daemon.service().register_layout_status_ =
        absl::InvalidArgumentError("tensor w box [0:5, 0:8] outside shape [4, 8]");
  }
  auto info = (*client)->RegisterLayout(PresetLayout{"megatron"});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("outside shape"));
  auto wait = (*client)->WaitVersion(13, absl::Seconds(2));
  EXPECT_EQ(wait.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(wait.status().message()), HasSubstr("lost its lease"));
}

TEST(WorkerClientTest, VersionCallsSendTheirTimeout) {
  std::string sock = TempSocket("timeout");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  auto pub = (*client)->Publish(3, absl::Seconds(7));
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(pub->version, 3u);
  EXPECT_DOUBLE_EQ(pub->stall_seconds, 0.25);
  EXPECT_FALSE((*client)->Publish(0, absl::Seconds(1)).ok());
  ASSERT_TRUE((*client)->BeginUpdate(absl::Milliseconds(1500)).ok());
  auto applied = (*client)->Apply(0, absl::Seconds(1));
  ASSERT_TRUE(applied.ok());
  EXPECT_EQ(applied->applied_version, 9u);
  absl::MutexLock l(&daemon.service().mu_);
  int64_t publish_ms = daemon.service().publish_.back().timeout_ms();
  EXPECT_GT(publish_ms, 6000);
  EXPECT_LE(publish_ms, 7000);
  int64_t begin_ms = daemon.service().begin_update_.back().timeout_ms();
  EXPECT_GT(begin_ms, 1000);
  EXPECT_LE(begin_ms, 1500);
}

TEST(WorkerClientTest, EndUpdateSendsItsTimeoutAndAnswersWhatLiveWeightsHold) {
  std::string sock = TempSocket("endupdate");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"rollout/0", planner::Role::kRollout, -1}).ok());
  auto ended = (*client)->EndUpdate(absl::Milliseconds(2500));
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_EQ(ended->applied_version, 4u);
  EXPECT_EQ(ended->committed_version, 5u);
  {
    absl::MutexLock l(&daemon.service().mu_);
    ASSERT_EQ(daemon.service().end_update_.size(), 1u);
    const pb::EndUpdateRequest& req = daemon.service().end_update_.back();
    EXPECT_EQ(req.worker_id(), "rollout/0");
    EXPECT_GT(req.timeout_ms(), 2000);
    EXPECT_LE(req.timeout_ms(), 2500);
    daemon.service().end_update_status_ =
        absl::DeadlineExceededError("EndUpdate: worker rollout/0 of model m on node n0: a copy of version 5 is still running");
  }
  ended = (*client)->EndUpdate(absl::Milliseconds(500));
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(ended.status().message()), HasSubstr("EndUpdate by rollout/0"));
  EXPECT_THAT(std::string(ended.status().message()), HasSubstr("still running"));
}

TEST(WorkerClientTest, ReconnectsAfterDaemonRestartAndReplaysRegistration) {
  std::string sock = TempSocket("restart");
  auto daemon = std::make_unique<FakeDaemon>(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  auto buf = c.CreateBuffer(64);
  ASSERT_TRUE(buf.ok());
  ASSERT_TRUE(c.RegisterLayout(PresetLayout{"fsdp"}).ok());
  std::string shm_name = (*buf)->shm_name;

  // The daemon dies; a new one (empty state) comes up on the same socket.
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  auto pub = c.Publish(2, absl::Seconds(5));
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(c.reconnects(), 1);
  absl::MutexLock l(&daemon->service().mu_);
  ASSERT_EQ(daemon->service().register_worker_.size(), 1u);
  EXPECT_EQ(daemon->service().register_worker_[0].worker_id(), "trainer/0");
  ASSERT_EQ(daemon->service().register_layout_.size(), 1u);
  EXPECT_EQ(daemon->service().register_layout_[0].buffers(0).shm_name(), shm_name);
  EXPECT_EQ(daemon->service().register_layout_[0].layout().preset().preset(), "fsdp");
  ASSERT_EQ(daemon->service().publish_.size(), 1u);
  EXPECT_EQ(daemon->service().publish_[0].version(), 2u);
}

// Every send of a registration carries the client's own token (RegisterWorkerRequest.client_instance,
// 32 hex characters, another one per client); the replay to a restarted daemon sends the same one,
// so the node takes it for this client's replay. A replay refused ALREADY_EXISTS (another client of
// this process took the worker id while the daemon restarted) fails the call, and the layout is not
// replayed over that client's registration (before, ALREADY_EXISTS was taken for "still registered").
TEST(WorkerClientTest, RegistrationsCarryTheClientsTokenAndAReplayRefusedAlreadyExistsFails) {
  std::string sock = TempSocket("token");
  auto daemon = std::make_unique<FakeDaemon>(sock);
  auto a = WorkerClient::Connect(sock, FastOptions());
  auto b = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  WorkerClient& c = **a;
  EXPECT_EQ(c.client_instance().size(), 32u);
  EXPECT_NE(c.client_instance(), (*b)->client_instance());
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  ASSERT_TRUE(c.CreateBuffer(64).ok());
  ASSERT_TRUE(c.RegisterLayout(PresetLayout{"fsdp"}).ok());
  {
    absl::MutexLock l(&daemon->service().mu_);
    ASSERT_EQ(daemon->service().register_worker_.size(), 1u);
    EXPECT_EQ(daemon->service().register_worker_[0].client_instance(), c.client_instance());
  }
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  auto pub = c.Publish(2, absl::Seconds(5));
  ASSERT_TRUE(pub.ok()) << pub.status();
  {
    absl::MutexLock l(&daemon->service().mu_);
    ASSERT_EQ(daemon->service().register_worker_.size(), 1u);
    EXPECT_EQ(daemon->service().register_worker_[0].client_instance(), c.client_instance()) << "the replay sent another token";
  }
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  {
    absl::MutexLock l(&daemon->service().mu_);
    daemon->service().register_worker_status_ =
        absl::AlreadyExistsError("worker trainer/0 of model tiny on node n0 is registered by another client of the same process");
  }
  pub = c.Publish(3, absl::Seconds(5));
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kAlreadyExists) << pub.status();
  absl::MutexLock l(&daemon->service().mu_);
  EXPECT_EQ(daemon->service().register_worker_.size(), 1u);
  EXPECT_TRUE(daemon->service().register_layout_.empty()) << "the layout was replayed over another client's registration";
  EXPECT_TRUE(daemon->service().publish_.empty());
}

// A sync rollout that resumed (EndUpdate) counts as paused again on a restarted daemon: the
// replay sends EndUpdate after the registrations. One that paused again (BeginUpdate) does not.
TEST(WorkerClientTest, AReplayEndsTheUpdateAgainForARolloutThatResumed) {
  std::string sock = TempSocket("resumed");
  auto daemon = std::make_unique<FakeDaemon>(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"rollout/0", planner::Role::kRollout, -1}).ok());
  ASSERT_TRUE(c.EndUpdate(absl::Seconds(2)).ok());
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  ASSERT_TRUE(c.Apply(0, absl::Seconds(5)).ok());
  EXPECT_EQ(c.reconnects(), 1);
  {
    absl::MutexLock l(&daemon->service().mu_);
    ASSERT_EQ(daemon->service().register_worker_.size(), 1u);
    ASSERT_EQ(daemon->service().end_update_.size(), 1u) << "the restarted daemon was not told that the rollout resumed";
    EXPECT_EQ(daemon->service().end_update_[0].worker_id(), "rollout/0");
  }
  // Paused again: a second restart replays no EndUpdate.
  ASSERT_TRUE(c.BeginUpdate(absl::Seconds(2)).ok());
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  ASSERT_TRUE(c.Apply(0, absl::Seconds(5)).ok());
  EXPECT_EQ(c.reconnects(), 2);
  absl::MutexLock l(&daemon->service().mu_);
  EXPECT_EQ(daemon->service().register_worker_.size(), 1u);
  EXPECT_TRUE(daemon->service().end_update_.empty());
}

TEST(WorkerClientTest, UnavailableOverAHealthyConnectionIsAnAnswerNotAReconnect) {
  std::string sock = TempSocket("draining");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  {
    absl::MutexLock l(&daemon.service().mu_);
    daemon.service().publish_status_ = absl::UnavailableError("node n1 is draining: version 4 refused");
  }
  auto pub = (*client)->Publish(4, absl::Seconds(5));
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(pub.status().message()), HasSubstr("draining"));
  EXPECT_EQ((*client)->reconnects(), 0);
  absl::MutexLock l(&daemon.service().mu_);
  EXPECT_EQ(daemon.service().register_worker_.size(), 1u);  // nothing replayed
  EXPECT_EQ(daemon.service().publish_.size(), 1u);          // not retried
}

// A call gRPC turned away for want of a server thread is sent again (proto/grpc_retry.h); the
// daemon's own RESOURCE_EXHAUSTED (a limit) is the answer.
TEST(WorkerClientTest, ACallTheDaemonHadNoThreadForIsSentAgain) {
  std::string sock = TempSocket("busy");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  {
    absl::MutexLock l(&daemon.service().mu_);
    daemon.service().publish_busy_ = 4;
  }
  auto pub = (*client)->Publish(3, absl::Seconds(5));
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(pub->version, 3u);
  {
    absl::MutexLock l(&daemon.service().mu_);
    EXPECT_EQ(daemon.service().publish_.size(), 5u);
    daemon.service().publish_status_ = absl::ResourceExhaustedError("4 blocked calls of worker trainer/0 (limit 4)");
  }
  pub = (*client)->Publish(4, absl::Seconds(5));
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(pub.status().message()), HasSubstr("limit 4"));
  absl::MutexLock l(&daemon.service().mu_);
  EXPECT_EQ(daemon.service().publish_.size(), 6u);  // not retried
  EXPECT_EQ((*client)->reconnects(), 0);
}

TEST(WorkerClientTest, GivesUpWithinDeadlineWhenDaemonStaysDown) {
  std::string sock = TempSocket("down");
  auto daemon = std::make_unique<FakeDaemon>(sock);
  ClientOptions o = FastOptions();
  o.reconnect_timeout = absl::Milliseconds(500);
  auto client = WorkerClient::Connect(sock, o);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, -1}).ok());
  daemon->Stop();
  absl::Time start = absl::Now();
  auto pub = (*client)->Publish(1, absl::Seconds(20));
  EXPECT_EQ(pub.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(WorkerClientTest, BuffersAreUnlinkedWhenTheClientGoes) {
  std::string sock = TempSocket("unlink");
  FakeDaemon daemon(sock);
  std::string name;
  {
    auto client = WorkerClient::Connect(sock, FastOptions());
    ASSERT_TRUE(client.ok());
    auto buf = (*client)->CreateBuffer(4096);
    ASSERT_TRUE(buf.ok());
    name = (*buf)->shm_name;
    EXPECT_TRUE(transport::ShmSegment::Open(name).ok());
  }
  EXPECT_EQ(transport::ShmSegment::Open(name).status().code(), absl::StatusCode::kNotFound);
}

TEST(WorkerClientTest, RejectsOverlongSocketPath) {
  auto client = WorkerClient::Connect("/tmp/" + std::string(120, 'x') + ".sock", FastOptions());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WorkerClientTest, RejectsBadModelConfigBeforeAnyRpc) {
  ModelConfig m = TinyModel();
  m.hf_config_json = "{}";  // and explicit tensors: ambiguous
  EXPECT_EQ(ModelSpecToProto(m).status().code(), absl::StatusCode::kInvalidArgument);
  m = TinyModel();
  m.model_id = "";
  EXPECT_EQ(ModelSpecToProto(m).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- CUDA VMM buffers: the fd channel next to the worker socket ----

// The node daemon's real fd channel at <sock>.fd, answering as the daemon's guard would: offers for
// worker "trainer/0" of model "tiny" from this process are accepted, anything else refused.
std::unique_ptr<daemon::FdChannel> FdChannelFor(const std::string& sock) {
  const pid_t me = getpid();
  auto c = daemon::FdChannel::Bind(sock + ".fd", 0600, [me](const daemon::PeerCred& sender, const std::string& model,
                                                            const std::string& worker) -> absl::Status {
    if (worker != "trainer/0" || model != "tiny") return absl::NotFoundError(absl::StrCat("worker ", worker, " is not registered"));
    if (sender.pid != me) return absl::PermissionDeniedError(absl::StrCat("worker trainer/0 belongs to process ", me));
    return absl::OkStatus();
  });
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

daemon::PeerCred Me() { return {getpid(), getuid(), getgid(), daemon::ProcessStartTime(getpid())}; }

// A memfd holding `text`: stands in for an exported allocation (nothing here looks inside).
int MemfdWith(const std::string& text) {
  const int fd = memfd_create("worker_client_test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

// What the daemon holds under (tiny, trainer/0, key), read back.
std::string HeldBy(const daemon::FdChannel& c, const std::string& key, int64_t* bytes = nullptr) {
  auto got = c.Get("tiny", "trainer/0", key, Me());
  if (!got.ok()) return std::string(got.status().ToString());
  char buf[64];
  const ssize_t n = pread(got->fd, buf, sizeof(buf), 0);
  close(got->fd);
  if (bytes != nullptr) *bytes = got->allocation_bytes;
  return n > 0 ? std::string(buf, n) : "";
}

TEST(WorkerClientTest, VmmAllocationIsSharedOnceAndItsBuffersNameIt) {
  std::string sock = TempSocket("vmm");
  FakeDaemon daemon(sock);
  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  const int fd = MemfdWith("the weights allocation");
  // The daemon takes fds only from registered workers: refused before any socket call.
  EXPECT_EQ(c.ShareCudaVmmAllocation("weights", fd, 4 << 20).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 1}).ok());
  EXPECT_EQ(c.AddCudaVmmBuffer("weights", 0, 64, 1).status().code(), absl::StatusCode::kFailedPrecondition)
      << "a buffer in an allocation that was never shared";
  EXPECT_EQ(c.ShareCudaVmmAllocation("", fd, 4 << 20).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.ShareCudaVmmAllocation(std::string(129, 'k'), fd, 4 << 20).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.ShareCudaVmmAllocation("weights", fd, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.ShareCudaVmmAllocation("weights", -1, 4 << 20).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(channel->size(), 0u);

  ASSERT_TRUE(c.ShareCudaVmmAllocation("weights", fd, 4 << 20).ok());
  EXPECT_EQ(c.ShareCudaVmmAllocation("weights", fd, 4 << 20).code(), absl::StatusCode::kAlreadyExists)
      << "one key, one allocation";
  close(fd);  // the caller's fd is its own: the client and the daemon keep theirs
  int64_t bytes = 0;
  EXPECT_EQ(HeldBy(*channel, "weights", &bytes), "the weights allocation");
  EXPECT_EQ(bytes, 4 << 20);

  EXPECT_EQ(c.AddCudaVmmBuffer("weights", -1, 64, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaVmmBuffer("weights", 0, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaVmmBuffer("weights", 0, 64, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaVmmBuffer("weights", 0, 64, 1, "short").status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.buffers().empty());
  auto a = c.AddCudaVmmBuffer("weights", 4096, 64, 1, std::string(16, 'u'));
  auto b = c.AddCudaVmmBuffer("weights", 1 << 20, 2048, 1);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ((*a)->id, 0u);
  EXPECT_EQ((*b)->id, 1u);
  EXPECT_EQ((*b)->data, nullptr);
  ASSERT_TRUE(c.RegisterLayout(PresetLayout{"fsdp"}).ok());
  EXPECT_EQ(channel->size(), 1u) << "one fd for both buffers";

  absl::MutexLock l(&daemon.service().mu_);
  const auto& rl = daemon.service().register_layout_.back();
  ASSERT_EQ(rl.buffers_size(), 2);
  EXPECT_EQ(rl.buffers(0).memory_case(), pb::BufferSpec::kCudaVmmKey);
  EXPECT_EQ(rl.buffers(0).cuda_vmm_key(), "weights");
  EXPECT_EQ(rl.buffers(0).cuda_vmm_offset(), 4096u);
  EXPECT_EQ(rl.buffers(0).size_bytes(), 64u);
  EXPECT_EQ(rl.buffers(0).gpu(), 1);
  EXPECT_EQ(rl.buffers(0).gpu_uuid(), std::string(16, 'u'));
  EXPECT_EQ(rl.buffers(1).cuda_vmm_key(), "weights");
  EXPECT_EQ(rl.buffers(1).cuda_vmm_offset(), 1u << 20);
  EXPECT_EQ(rl.buffers(1).size_bytes(), 2048u);
  EXPECT_EQ(rl.buffers(1).buffer_id(), 1u);
  EXPECT_TRUE(rl.buffers(1).gpu_uuid().empty());
}

// A buffer over several allocations (a tensor in a PyTorch expandable segment spans several
// pages): each allocation shared once, the buffer names them in order.
TEST(WorkerClientTest, VmmBufferOverSeveralAllocationsNamesThemInOrder) {
  std::string sock = TempSocket("vmmmulti");
  FakeDaemon daemon(sock);
  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 1}).ok());
  for (const char* key : {"page0", "page1", "page2"}) {
    const int fd = MemfdWith(key);
    ASSERT_TRUE(c.ShareCudaVmmAllocation(key, fd, 2 << 20).ok());
    close(fd);
  }
  using Keys = std::vector<std::string>;
  auto unknown = c.AddCudaVmmBuffer(Keys{"page0", "page9"}, 0, 64, 1);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("no allocation shared under key 'page9'"));
  auto twice = c.AddCudaVmmBuffer(Keys{"page0", "page1", "page0"}, 0, 64, 1);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("names allocation 'page0' twice"));
  EXPECT_EQ(c.AddCudaVmmBuffer(Keys{}, 0, 64, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AddCudaVmmBuffer(Keys{"page0", "page1"}, 0, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(c.buffers().empty());
  auto span = c.AddCudaVmmBuffer(Keys{"page0", "page1", "page2"}, 4096, (4 << 20) + 100, 1);
  ASSERT_TRUE(span.ok()) << span.status();
  auto one = c.AddCudaVmmBuffer(Keys{"page2"}, 8, 64, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(c.RegisterLayout(PresetLayout{"fsdp"}).ok());
  EXPECT_EQ(channel->size(), 3u) << "one fd per allocation, however many buffers name it";

  absl::MutexLock l(&daemon.service().mu_);
  const auto& rl = daemon.service().register_layout_.back();
  ASSERT_EQ(rl.buffers_size(), 2);
  EXPECT_EQ(rl.buffers(0).memory_case(), pb::BufferSpec::kCudaVmmKey);
  EXPECT_EQ(rl.buffers(0).cuda_vmm_key(), "page0");
  EXPECT_EQ(Keys(rl.buffers(0).cuda_vmm_next_keys().begin(), rl.buffers(0).cuda_vmm_next_keys().end()), (Keys{"page1", "page2"}));
  EXPECT_EQ(rl.buffers(0).cuda_vmm_offset(), 4096u);
  EXPECT_EQ(rl.buffers(0).size_bytes(), (4u << 20) + 100);
  EXPECT_EQ(rl.buffers(1).cuda_vmm_key(), "page2");
  EXPECT_TRUE(rl.buffers(1).cuda_vmm_next_keys().empty()) << "one allocation: as AddCudaVmmBuffer(key, ...)";
}

// Every allocation is offered with an id unique in the process (VmmFdOffer::allocation_id): two
// clients of one process sharing their own allocations under one key in turn are two allocations
// to the daemon (two cache keys: each mapped), not a replay of the first.
TEST(WorkerClientTest, VmmAllocationsUnderOneKeyFromTwoClientsAreTwoAllocations) {
  std::string sock = TempSocket("vmmids");
  FakeDaemon daemon(sock);
  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  std::vector<std::string> cache_keys;
  for (const char* what : {"first allocation", "second allocation"}) {
    auto client = WorkerClient::Connect(sock, FastOptions());
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 1}).ok());
    const int fd = MemfdWith(what);
    ASSERT_TRUE((*client)->ShareCudaVmmAllocation("weights", fd, 2 << 20).ok());
    close(fd);
    auto got = channel->Get("tiny", "trainer/0", "weights", Me());
    ASSERT_TRUE(got.ok()) << got.status();
    close(got->fd);
    cache_keys.push_back(got->cache_key);
  }
  EXPECT_NE(cache_keys[0], cache_keys[1]);
}

TEST(WorkerClientTest, VmmRefusalsCarryTheDaemonsCodeAndMessage) {
  std::string sock = TempSocket("vmmno");
  FakeDaemon daemon(sock);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  // Registered as a worker the fd channel does not know (its guard answers NOT_FOUND).
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"rollout/3", planner::Role::kRollout, 0}).ok());
  const int fd = MemfdWith("x");
  // No fd channel at all (a daemon without one): UNAVAILABLE naming the socket.
  absl::Status none = c.ShareCudaVmmAllocation("weights", fd, 2 << 20);
  EXPECT_EQ(none.code(), absl::StatusCode::kUnavailable) << none;
  EXPECT_THAT(std::string(none.message()), HasSubstr(sock + ".fd"));

  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  absl::Status refused = c.ShareCudaVmmAllocation("weights", fd, 2 << 20);
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("worker rollout/3 is not registered"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("'weights'"));
  EXPECT_EQ(c.AddCudaVmmBuffer("weights", 0, 64, 0).status().code(), absl::StatusCode::kFailedPrecondition)
      << "a refused allocation is not remembered";
  EXPECT_EQ(channel->size(), 0u);
  close(fd);
}

TEST(WorkerClientTest, VmmRangePastTheAllocationIsTheDaemonsAnswer) {
  std::string sock = TempSocket("vmmrange");
  FakeDaemon daemon(sock);
  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 0}).ok());
  const int fd = MemfdWith("x");
  ASSERT_TRUE(c.ShareCudaVmmAllocation("weights", fd, 2 << 20).ok());
  close(fd);
  // The client does not know the allocation's real extent; the daemon, which maps it, says no.
  ASSERT_TRUE(c.AddCudaVmmBuffer("weights", 2 << 20, 64, 0).ok());
  {
    absl::MutexLock l(&daemon.service().mu_);
    daemon.service().register_layout_status_ = absl::InvalidArgumentError(
        "buffer 0 (GPU 0): cuda_ipc VMM import of region 'x': bytes [2097152, 2097216) exceed the allocation of 2097152 bytes");
  }
  auto info = c.RegisterLayout(PresetLayout{"fsdp"});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("exceed the allocation"));
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("RegisterLayout of worker trainer/0"));
}

TEST(WorkerClientTest, VmmFdsAreSentAgainToARestartedDaemon) {
  std::string sock = TempSocket("vmmrestart");
  auto daemon = std::make_unique<FakeDaemon>(sock);
  auto channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  auto client = WorkerClient::Connect(sock, FastOptions());
  ASSERT_TRUE(client.ok());
  WorkerClient& c = **client;
  ASSERT_TRUE(c.RegisterWorker(TinyModel(), {"trainer/0", planner::Role::kTrainer, 0}).ok());
  int fd = MemfdWith("first");
  ASSERT_TRUE(c.ShareCudaVmmAllocation("a", fd, 2 << 20).ok());
  close(fd);
  fd = MemfdWith("second");
  ASSERT_TRUE(c.ShareCudaVmmAllocation("b", fd, 4 << 20).ok());
  close(fd);
  ASSERT_TRUE(c.AddCudaVmmBuffer("a", 0, 64, 0).ok());
  ASSERT_TRUE(c.AddCudaVmmBuffer("b", 64, 64, 0).ok());
  ASSERT_TRUE(c.RegisterLayout(PresetLayout{"fsdp"}).ok());

  // The daemon dies with its fd channel; a new one (holding no fds) comes up at the same paths.
  channel.reset();
  daemon->Stop();
  daemon = std::make_unique<FakeDaemon>(sock);
  channel = FdChannelFor(sock);
  ASSERT_NE(channel, nullptr);
  ASSERT_EQ(channel->size(), 0u);
  auto pub = c.Publish(2, absl::Seconds(5));
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_EQ(c.reconnects(), 1);
  // Sent again, from the dups the client kept, before the layout that names them.
  EXPECT_EQ(channel->size(), 2u);
  int64_t bytes = 0;
  EXPECT_EQ(HeldBy(*channel, "a"), "first");
  EXPECT_EQ(HeldBy(*channel, "b", &bytes), "second");
  EXPECT_EQ(bytes, 4 << 20);
  absl::MutexLock l(&daemon->service().mu_);
  ASSERT_EQ(daemon->service().register_layout_.size(), 1u);
  EXPECT_EQ(daemon->service().register_layout_[0].buffers(1).cuda_vmm_key(), "b");
  EXPECT_EQ(daemon->service().register_layout_[0].buffers(1).cuda_vmm_offset(), 64u);
}

}  // namespace
}  // namespace wb::client

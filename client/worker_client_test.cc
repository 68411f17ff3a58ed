// Unit tests of the worker client against an in-process fake WorkerService on a temporary Unix
// socket (a fake isolates the client; the real daemon is exercised by tests/e2e/).
#include "client/worker_client.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "transport/shm_segment.h"

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
  std::vector<pb::RegisterWorkerRequest> register_worker_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::RegisterLayoutRequest> register_layout_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::PublishRequest> publish_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::BeginUpdateRequest> begin_update_ ABSL_GUARDED_BY(mu_);
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
  preset.preset = "vllm";
  preset.tp = 2;
  preset.rank = 1;
  ASSERT_TRUE((*client)->RegisterLayout(preset).ok());
  absl::MutexLock l(&daemon.service().mu_);
  const auto& pc = daemon.service().register_layout_.back().layout().preset();
  EXPECT_EQ(pc.preset(), "vllm");
  EXPECT_EQ(pc.tp(), 2u);
  EXPECT_EQ(pc.rank(), 1u);
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

}  // namespace
}  // namespace wb::client

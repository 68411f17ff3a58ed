// Coordinator + 2 node daemons in one process with mutual TLS + token between them, workers on the
// SO_PEERCRED socket, and the metrics endpoint scraped over HTTP before and after real versions.
// A node without the token cannot join (UNAUTHENTICATED); the host_tcp data channel between the
// nodes authenticates with the same token (transport/host_tcp/host_tcp_test.cc covers its refusals).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/metrics_scrape.h"
#include "daemon/server.h"
#include "gtest/gtest.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tests/common/test_certs.h"
#include "tests/common/weight_gen.h"
#include "transport/factory.h"
#include "base/shm_segment.h"

namespace wb::daemon {
namespace {

struct Worker {
  std::string id;
  pb::Role role;
  int64_t begin, end;  // rows of tensor "a" [rows x 16] f32
  transport::ShmSegment seg;
  std::unique_ptr<pb::WorkerService::Stub> stub;
};
constexpr int64_t kRows = 8, kCols = 16, kElem = 4;

class SecureClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/secure-certs";
    ASSERT_EQ(MakeTestCerts(dir_, {"coordinator", "n0", "n1", "n5"}, "wb-test-ca", {{"token", "cluster-token"}}), "");
    auth_ = Auth("coordinator");
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.security.peer_auth = auth_;
    co.security.metrics_listen = "127.0.0.1:0";
    auto c = Server::Start(co);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
    for (int n = 0; n < 2; ++n) {
      auto s = Server::Start(NodeOptions(n, Auth(absl::StrCat("n", n))));
      ASSERT_TRUE(s.ok()) << s.status();
      nodes_.push_back(std::move(*s));
    }
  }
  // The certificate of `name` (CN=name), the shared CA and the token.
  std::shared_ptr<PeerAuthConfig> Auth(const std::string& name) {
    auto auth = LoadPeerAuth(dir_ + "/" + name + ".pem", dir_ + "/" + name + ".key", dir_ + "/ca.pem", dir_ + "/token");
    EXPECT_TRUE(auth.ok()) << auth.status();
    return auth.ok() ? std::make_shared<PeerAuthConfig>(*auth) : nullptr;
  }
  ServerOptions NodeOptions(int n, std::shared_ptr<const PeerAuthConfig> auth) {
    ServerOptions no;
    no.role = DaemonRole::kNode;
    no.node_id = absl::StrCat("n", n);
    no.coordinator = coord_->address();
    no.worker_socket = absl::StrCat("/tmp/wbsec-", ::getpid(), "-", n, ".sock");
    no.heartbeat = absl::Milliseconds(100);
    // The data channel proves the same token as the RPCs (as daemon/main.cc wires it).
    const std::string data_token = auth ? auth->token : "";
    no.make_transports = [data_token] {
      transport::TransportConfig tc;
      tc.kinds = {"host_shm", "host_tcp"};
      tc.tcp.auth_token = data_token;
      return transport::CreateTransports(tc);
    };
    no.security.peer_auth = std::move(auth);
    no.security.metrics_listen = "127.0.0.1:0";
    return no;
  }
  void TearDown() override {
    for (auto& n : nodes_) n->Shutdown();
    if (coord_) coord_->Shutdown();
  }
  Worker Make(const std::string& id, pb::Role role, int node, int64_t begin, int64_t end) {
    Worker w{id, role, begin, end, {}, nullptr};
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("sec"), (end - begin) * kCols * kElem);
    EXPECT_TRUE(seg.ok());
    w.seg = std::move(*seg);
    w.stub = pb::WorkerService::NewStub(grpc::CreateChannel("unix:" + nodes_[node]->worker_socket(), grpc::InsecureChannelCredentials()));
    return w;
  }
  grpc::Status Register(Worker& w, const pb::ModelSpec& spec) {
    grpc::ClientContext c1;
    pb::RegisterWorkerRequest rw;
    rw.set_model_id("m");
    rw.set_worker_id(w.id);
    rw.set_role(w.role);
    *rw.mutable_model() = spec;
    pb::RegisterWorkerResponse rwr;
    grpc::Status s = w.stub->RegisterWorker(&c1, rw, &rwr);
    if (!s.ok()) return s;
    pb::RegisterLayoutRequest rl;
    rl.set_model_id("m");
    rl.set_worker_id(w.id);
    pb::BufferSpec* b = rl.add_buffers();
    b->set_buffer_id(0);
    b->set_size_bytes(static_cast<uint64_t>(w.seg.size()));
    b->set_shm_name(w.seg.name());
    b->set_gpu(-1);
    pb::Piece* p = rl.mutable_layout()->mutable_pieces()->add_pieces();
    p->set_tensor("a");
    p->mutable_box()->add_begin(w.begin);
    p->mutable_box()->add_begin(0);
    p->mutable_box()->add_end(w.end);
    p->mutable_box()->add_end(kCols);
    p->add_strides(kCols);
    p->add_strides(1);
    grpc::ClientContext c2;
    pb::RegisterLayoutResponse rlr;
    return w.stub->RegisterLayout(&c2, rl, &rlr);
  }
  void Fill(Worker& w, uint64_t v) {
    for (int64_t i = w.begin * kCols; i < w.end * kCols; ++i)
      WriteWeight(0, v, i, kElem, static_cast<uint8_t*>(w.seg.data()) + (i - w.begin * kCols) * kElem);
  }
  int64_t Bad(const Worker& w, uint64_t v) {
    int64_t bad = 0;
    for (int64_t i = w.begin * kCols; i < w.end * kCols; ++i)
      bad += !CheckWeight(0, v, i, kElem, static_cast<const uint8_t*>(w.seg.data()) + (i - w.begin * kCols) * kElem);
    return bad;
  }

  std::string dir_;
  std::shared_ptr<PeerAuthConfig> auth_;
  std::unique_ptr<Server> coord_;
  std::vector<std::unique_ptr<Server>> nodes_;
};

TEST_F(SecureClusterTest, VersionsFlowOverTlsAndMetricsMove) {
  pb::ModelSpec spec;
  spec.set_model_id("m");
  pb::TensorSpec* t = spec.mutable_explicit_tensors()->add_tensors();
  t->set_name("a");
  t->add_shape(kRows);
  t->add_shape(kCols);
  t->set_dtype(pb::DTYPE_F32);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(2);
  spec.set_mode(pb::MODE_ASYNC);
  Worker tr = Make("t0", pb::ROLE_TRAINER, 0, 0, kRows);
  Worker r0 = Make("r0", pb::ROLE_ROLLOUT, 0, 0, kRows / 2);
  Worker r1 = Make("r1", pb::ROLE_ROLLOUT, 1, kRows / 2, kRows);
  for (Worker* w : {&tr, &r0, &r1}) ASSERT_TRUE(Register(*w, spec).ok()) << w->id;

  ASSERT_GT(nodes_[1]->metrics_port(), 0);
  auto before = ScrapeMetrics(nodes_[1]->metrics_port(), absl::Seconds(10));
  ASSERT_TRUE(before.ok()) << before.status();
  const double committed_before = MetricSum(*before, "wb_versions_total", "event=\"committed\",model=\"m\",node=\"n1\"");
  const double tcp_bytes_before = MetricSum(*before, "wb_bytes_total", "node=\"n0\",peer=\"n1\",route=\"host_tcp\"");

  // No barrier version before the scrape: the node counts a commit before a rollout's Apply can
  // see it, so right after Apply(3) the scrape finds version 3's counts.
  for (uint64_t v = 1; v <= 3; ++v) {
    Fill(tr, v);
    grpc::ClientContext pc;
    pb::PublishRequest pr;
    pr.set_model_id("m");
    pr.set_worker_id("t0");
    pr.set_version(v);
    pr.set_timeout_ms(20000);
    pb::PublishResponse presp;
    ASSERT_TRUE(tr.stub->Publish(&pc, pr, &presp).ok());
    for (Worker* r : {&r0, &r1}) {
      grpc::ClientContext ac;
      pb::ApplyRequest ar;
      ar.set_model_id("m");
      ar.set_worker_id(r->id);
      ar.set_version(v);
      ar.set_timeout_ms(20000);
      pb::ApplyResponse aresp;
      grpc::Status s = r->stub->Apply(&ac, ar, &aresp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(Bad(*r, aresp.applied_version()), 0) << r->id;
    }
  }
  auto after = ScrapeMetrics(nodes_[1]->metrics_port(), absl::Seconds(10));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(MetricSum(*after, "wb_versions_total", "event=\"committed\",model=\"m\",node=\"n1\"") - committed_before, 3);
  EXPECT_GT(MetricSum(*after, "wb_versions_total", "event=\"published\",model=\"m\",node=\"n0\""), 0);
  EXPECT_GT(MetricSum(*after, "wb_phase_seconds_count", "phase=\"apply\""), 0);
  EXPECT_GT(MetricSum(*after, "wb_phase_seconds_count", "phase=\"commit\""), 0);
  EXPECT_GT(MetricSum(*after, "wb_phase_seconds_count", "phase=\"transfer\""), 0);
  EXPECT_EQ(MetricSum(*after, "wb_staleness_versions", "worker=\"r1\""), 0);
  EXPECT_GE(MetricSum(*after, "wb_committed_version", "node=\"n1\""), 3);
  // The executor records bytes per route and peer, and GB/s per link: n0 sends r1's half (rows
  // kRows/2..kRows of the trainer) to n1 over host_tcp on every version.
  const double tcp_bytes = MetricSum(*after, "wb_bytes_total", "node=\"n0\",peer=\"n1\",route=\"host_tcp\"") - tcp_bytes_before;
  EXPECT_GE(tcp_bytes, 3.0 * (kRows / 2) * kCols * kElem) << "cross-node bytes of 3 versions";
  EXPECT_GT(MetricSum(*after, "wb_bytes_total", "node=\"n0\",peer=\"n0\",route=\"host_shm\""), 0);
  EXPECT_GT(MetricSum(*after, "wb_link_gbps", "node=\"n0\",peer=\"n1\""), 0);
}

// Issue 14.3: metrics are injected, not global. A daemon given its own DaemonMetrics counts there
// (its endpoint shows the call it refused); the process default the other daemons here share does not.
TEST_F(SecureClusterTest, DaemonWithItsOwnMetricsCountsThere) {
  DaemonMetrics own;  // declared first: outlives the daemon
  ServerOptions o = NodeOptions(5, Auth("n5"));
  o.metrics = &own;
  auto n5 = Server::Start(std::move(o));
  ASSERT_TRUE(n5.ok()) << n5.status();
  PeerAuthConfig no_token = *Auth("n0");
  no_token.token.clear();
  auto stub = pb::NodeService::NewStub(MakePeerChannel((*n5)->address(), no_token));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::StatusResponse resp;
  grpc::Status s = stub->Status(&ctx, pb::StatusRequest(), &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  auto mine = ScrapeMetrics((*n5)->metrics_port(), absl::Seconds(10));
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_GE(MetricSum(*mine, "wb_rejected_total", "node=\"n5\",what=\"unauthenticated\""), 1);
  auto shared = ScrapeMetrics(nodes_[0]->metrics_port(), absl::Seconds(10));
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(MetricSum(*shared, "wb_rejected_total", "node=\"n5\""), 0);
  (*n5)->Shutdown();
}

TEST_F(SecureClusterTest, NodeWithoutTokenOrCertificateIsRefused) {
  auto no_token = Auth("n5");
  no_token->token.clear();
  auto s = Server::Start(NodeOptions(5, no_token));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnauthenticated) << s.status();
  auto plain = Server::Start(NodeOptions(6, nullptr));
  EXPECT_FALSE(plain.ok());
}

// Issue 15.11: with mutual TLS a node acts only as the node its certificate names: n1's
// certificate (and the cluster token) can neither re-register as n0 (which would replace n0's
// address) nor heartbeat as n0; both are PERMISSION_DENIED naming both ids, and n0 is untouched.
TEST_F(SecureClusterTest, NodeCannotActAsAnotherNode) {
  auto stub = pb::CoordinatorService::NewStub(MakePeerChannel(coord_->address(), *Auth("n1")));
  {
    pb::RegisterNodeRequest req;
    req.set_node_id("n0");
    req.set_address("127.0.0.1:1");
    pb::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("'n0'"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("n1"), std::string::npos) << s.error_message();
  }
  {
    pb::HeartbeatRequest req;
    req.set_node_id("n0");
    pb::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  // Its own id is fine, and n0 still has its own address.
  pb::HeartbeatRequest req;
  req.set_node_id("n1");
  pb::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
  EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  pb::StatusRequest sreq;
  pb::StatusResponse sresp;
  grpc::ClientContext sctx;
  ASSERT_TRUE(stub->ClusterStatus(&sctx, sreq, &sresp).ok());
  for (const auto& n : sresp.nodes()) {
    if (n.node_id() == "n0") {
      EXPECT_EQ(n.address(), nodes_[0]->address());
    }
  }
}

}  // namespace
}  // namespace wb::daemon

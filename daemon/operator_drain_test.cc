// The operator credential for Drain (docs/security.md "Operators") and wbctl against a secured
// cluster: real coordinator and node daemons in this process, mutual TLS + the cluster token, and
// wbctl's own subcommands (RunStatusCommand / RunDrainCommand) dialing them as an operator would.
//
//  - wbctl reaches a TLS + token cluster with --tls_* / --auth_token_file, and without them fails
//    naming the flags to add;
//  - with --operator_token_file / --operator_names on the daemons, a cluster identity that is not
//    an operator cannot drain the cluster or another node, nor lift a drain; a node's own
//    certificate may still drain itself; the operator token or an operator certificate may do all
//    of it, directly at the coordinator or through any node (which forwards with its own copy of
//    the operator token);
//  - the same with the token alone (no TLS): there is no per-node identity, so every drain needs
//    the operator token.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "client/drain_command.h"
#include "client/status_command.h"
#include "daemon/server.h"
#include "gtest/gtest.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tests/common/test_certs.h"
#include "transport/factory.h"

namespace wb::daemon {
namespace {

struct CtlResult {
  int code = -1;
  std::string out, err;
};

class OperatorDrainTest : public ::testing::TestWithParam<bool> {
 protected:
  bool tls() const { return GetParam(); }

  void SetUp() override {
    dir_ = ::testing::TempDir() + (tls() ? "/operator-tls" : "/operator-token");
    ASSERT_EQ(MakeTestCerts(dir_, {"coordinator", "n0", "n1", "ops", "intruder"}, "wb-test-ca",
                            {{"token", "cluster-token"}, {"operator", "operator-token-123"}, {"wrong", "not-the-operator"}}),
              "");
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.security.peer_auth = DaemonAuth("coordinator");
    auto c = Server::Start(co);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
    for (int n = 0; n < 2; ++n) {
      ServerOptions no;
      no.role = DaemonRole::kNode;
      no.node_id = absl::StrCat("n", n);
      no.coordinator = coord_->address();
      no.worker_socket = absl::StrCat("/tmp/wbop-", ::getpid(), "-", tls(), "-", n, ".sock");
      no.heartbeat = absl::Milliseconds(100);
      no.make_transports = [] {
        transport::TransportConfig tc;
        tc.kinds = {"host_shm", "host_tcp"};
        tc.tcp.auth_token = "cluster-token";
        return transport::CreateTransports(tc);
      };
      no.security.peer_auth = DaemonAuth(no.node_id);
      auto s = Server::Start(no);
      ASSERT_TRUE(s.ok()) << s.status();
      nodes_.push_back(std::move(*s));
    }
    // A model, so that a cluster drain shows (ModelStatus.draining).
    pb::CreateModelRequest req;
    pb::ModelSpec* spec = req.mutable_model();
    spec->set_model_id("m");
    pb::TensorSpec* t = spec->mutable_explicit_tensors()->add_tensors();
    t->set_name("a");
    t->add_shape(8);
    t->add_shape(16);
    t->set_dtype(pb::DTYPE_F32);
    spec->set_num_trainer_workers(1);
    spec->set_num_rollout_workers(1);
    pb::CreateModelResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = CoordStub("n0")->CreateModel(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  void TearDown() override {
    for (auto& n : nodes_) n->Shutdown();
    if (coord_) coord_->Shutdown();
  }

  // A daemon's credentials: (TLS: its certificate), the cluster token, the operator token, and
  // (TLS) "ops" as the operator certificate name.
  std::shared_ptr<PeerAuthConfig> DaemonAuth(const std::string& name) {
    auto auth = tls() ? LoadPeerAuth(Path(name + ".pem"), Path(name + ".key"), Path("ca.pem"), Path("token"))
                      : LoadPeerAuth("", "", "", Path("token"));
    EXPECT_TRUE(auth.ok()) << auth.status();
    if (!auth.ok()) return nullptr;
    EXPECT_TRUE(LoadOperatorCredential(Path("operator"), tls() ? "ops" : "", &*auth).ok());
    return std::make_shared<PeerAuthConfig>(*auth);
  }
  std::string Path(const std::string& f) const { return dir_ + "/" + f; }

  // wbctl's credential flags as identity `who` ("" = none at all), with or without the operator token.
  std::vector<std::string> Creds(const std::string& who, const std::string& operator_file = "") {
    std::vector<std::string> a;
    if (who.empty()) return a;
    if (tls()) a = {"--tls_ca", Path("ca.pem"), "--tls_cert", Path(who + ".pem"), "--tls_key", Path(who + ".key")};
    a.push_back("--auth_token_file");
    a.push_back(Path("token"));
    if (!operator_file.empty()) {
      a.push_back("--operator_token_file");
      a.push_back(Path(operator_file));
    }
    return a;
  }
  CtlResult Drain(const std::string& addr, std::vector<std::string> extra, std::vector<std::string> creds) {
    std::vector<std::string> args = {"--addr", addr, "--timeout", "5s", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), creds.begin(), creds.end());
    std::ostringstream out, err;
    CtlResult r;
    r.code = client::RunDrainCommand(args, out, err);
    r.out = out.str();
    r.err = err.str();
    return r;
  }
  std::unique_ptr<pb::CoordinatorService::Stub> CoordStub(const std::string& who) {
    auto auth = tls() ? LoadPeerAuth(Path(who + ".pem"), Path(who + ".key"), Path("ca.pem"), Path("token"))
                      : LoadPeerAuth("", "", "", Path("token"));
    EXPECT_TRUE(auth.ok());
    return pb::CoordinatorService::NewStub(MakePeerChannel(coord_->address(), *auth));
  }
  pb::StatusResponse Status() {
    pb::StatusResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = CoordStub("n0")->ClusterStatus(&ctx, pb::StatusRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }
  bool NodeDraining(const std::string& id) {
    const pb::StatusResponse status = Status();
    for (const auto& n : status.nodes()) {
      if (n.node_id() == id) return n.draining();
    }
    ADD_FAILURE() << "no node " << id;
    return false;
  }
  bool ClusterDraining() {
    const pb::StatusResponse status = Status();
    for (const auto& m : status.models()) {
      if (m.model_id() == "m") return m.draining();
    }
    ADD_FAILURE() << "no model m";
    return false;
  }

  std::string dir_;
  std::unique_ptr<Server> coord_;
  std::vector<std::unique_ptr<Server>> nodes_;
};

TEST_P(OperatorDrainTest, WbctlReachesTheSecuredClusterAndNamesMissingFlags) {
  std::vector<std::string> args = {"--addr", coord_->address(), "--json", "--timeout", "5s"};
  std::vector<std::string> with = args;
  for (const std::string& f : Creds("intruder")) with.push_back(f);
  std::ostringstream out, err;
  ASSERT_EQ(client::RunStatusCommand(with, out, err), 0) << err.str();
  EXPECT_NE(out.str().find("\"n0\""), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("\"n1\""), std::string::npos) << out.str();

  // Without any credential: refused, and the error says which flags the daemons need.
  std::ostringstream out2, err2;
  args[args.size() - 1] = "2s";
  EXPECT_EQ(client::RunStatusCommand(args, out2, err2), 1);
  EXPECT_NE(err2.str().find("--tls_ca"), std::string::npos) << err2.str();
  if (!tls()) {
    EXPECT_NE(err2.str().find("--auth_token_file"), std::string::npos) << err2.str();
  }

  // A wrong credential file is a usage error naming the flag.
  std::ostringstream out3, err3;
  std::vector<std::string> bad = args;
  bad.push_back("--auth_token_file");
  bad.push_back(Path("missing-file"));
  EXPECT_EQ(client::RunStatusCommand(bad, out3, err3), 2);
  EXPECT_NE(err3.str().find("--auth_token_file"), std::string::npos) << err3.str();
}

TEST_P(OperatorDrainTest, OnlyAnOperatorDrainsTheClusterOrAnotherNode) {
  const std::string coord = coord_->address();
  // A cluster identity without the operator credential: the cluster, another node, an undo.
  for (const auto& extra : std::vector<std::vector<std::string>>{{"--all"}, {"--node", "n1"}, {"--all", "--undo"}}) {
    CtlResult r = Drain(coord, extra, Creds("intruder"));
    EXPECT_EQ(r.code, 1) << extra[0] << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("PERMISSION_DENIED"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("needs the operator credential"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("--operator_token_file"), std::string::npos) << r.err;  // wbctl's hint
  }
  // A wrong operator token is refused too.
  CtlResult wrong = Drain(coord, {"--node", "n1"}, Creds("intruder", "wrong"));
  EXPECT_EQ(wrong.code, 1) << wrong.err;
  EXPECT_NE(wrong.err.find("wrong"), std::string::npos) << wrong.err;
  EXPECT_FALSE(ClusterDraining());
  EXPECT_FALSE(NodeDraining("n1"));

  // Another node's certificate cannot drain n1 either (directly, as a node would call it).
  {
    pb::DrainRequest req;
    req.set_node_id("n1");
    req.set_timeout_ms(1000);
    pb::DrainResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = CoordStub("n0")->Drain(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_FALSE(NodeDraining("n1"));
  }

  // The operator token: the cluster, then the undo.
  CtlResult all = Drain(coord, {"--all"}, Creds("intruder", "operator"));
  EXPECT_EQ(all.code, 0) << all.err;
  EXPECT_TRUE(ClusterDraining());
  CtlResult undo = Drain(coord, {"--all", "--undo"}, Creds("intruder", "operator"));
  EXPECT_EQ(undo.code, 0) << undo.err;
  EXPECT_FALSE(ClusterDraining());

  // Through a node: n0 checks the operator token and forwards the drain of n1 with its own copy.
  CtlResult via = Drain(nodes_[0]->address(), {"--node", "n1"}, Creds("intruder", "operator"));
  EXPECT_EQ(via.code, 0) << via.err;
  EXPECT_TRUE(NodeDraining("n1"));
  // ... which a non-operator cannot do through a node.
  CtlResult via_bad = Drain(nodes_[0]->address(), {"--node", "n1", "--undo"}, Creds("intruder"));
  EXPECT_EQ(via_bad.code, 1) << via_bad.err;
  EXPECT_NE(via_bad.err.find("NodeService.Drain"), std::string::npos) << via_bad.err;
  EXPECT_TRUE(NodeDraining("n1"));
  CtlResult via_undo = Drain(nodes_[0]->address(), {"--node", "n1", "--undo"}, Creds("intruder", "operator"));
  EXPECT_EQ(via_undo.code, 0) << via_undo.err;
  EXPECT_FALSE(NodeDraining("n1"));

  if (tls()) {
    // An operator certificate ("ops", named in --operator_names) needs no token.
    CtlResult ops = Drain(coord, {"--node", "n1"}, Creds("ops"));
    EXPECT_EQ(ops.code, 0) << ops.err;
    EXPECT_TRUE(NodeDraining("n1"));
    EXPECT_EQ(Drain(coord, {"--node", "n1", "--undo"}, Creds("ops")).code, 0);
    EXPECT_FALSE(NodeDraining("n1"));
    // A node's own certificate drains and undrains its own node (at the coordinator and at itself).
    EXPECT_EQ(Drain(coord, {"--node", "n0"}, Creds("n0")).code, 0);
    EXPECT_TRUE(NodeDraining("n0"));
    EXPECT_EQ(Drain(nodes_[0]->address(), {"--undo"}, Creds("n0")).code, 0);
    EXPECT_FALSE(NodeDraining("n0"));
    // ... but not the cluster.
    EXPECT_EQ(Drain(coord, {"--all"}, Creds("n0")).code, 1);
  } else {
    // No TLS, no per-node identity: a node's own drain needs the operator token too.
    CtlResult self = Drain(nodes_[0]->address(), {}, Creds("intruder"));
    EXPECT_EQ(self.code, 1) << self.err;
    EXPECT_FALSE(NodeDraining("n0"));
    EXPECT_EQ(Drain(nodes_[0]->address(), {}, Creds("intruder", "operator")).code, 0);
    EXPECT_TRUE(NodeDraining("n0"));
  }
  EXPECT_FALSE(ClusterDraining());
}

INSTANTIATE_TEST_SUITE_P(TlsAndTokenOnly, OperatorDrainTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "MutualTls" : "TokenOnly"; });

TEST(OperatorCredentialTest, LoadRefusesWhatCannotWork) {
  const std::string dir = ::testing::TempDir() + "/operator-load";
  ASSERT_EQ(MakeTestCerts(dir, {"n0"}, "ca", {{"token", "cluster-token\n"}, {"same", " cluster-token "}, {"empty", "\n"}, {"op", "op-1"}}), "");
  auto plain = LoadPeerAuth("", "", "", dir + "/token");
  ASSERT_TRUE(plain.ok());
  PeerAuthConfig c = *plain;
  absl::Status same = LoadOperatorCredential(dir + "/same", "", &c);
  EXPECT_EQ(same.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(same.message().find("cluster token"), std::string::npos) << same;
  EXPECT_EQ(LoadOperatorCredential(dir + "/empty", "", &c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadOperatorCredential(dir + "/nope", "", &c).code(), absl::StatusCode::kInvalidArgument);
  absl::Status names = LoadOperatorCredential("", "ops", &c);
  EXPECT_EQ(names.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(names.message().find("--tls_cert"), std::string::npos) << names;
  PeerAuthConfig ok = *plain;
  ASSERT_TRUE(LoadOperatorCredential(dir + "/op", "", &ok).ok());
  EXPECT_EQ(ok.operator_token, "op-1");
  EXPECT_TRUE(ok.operator_required());
  EXPECT_FALSE(plain->operator_required());
}

}  // namespace
}  // namespace wb::daemon

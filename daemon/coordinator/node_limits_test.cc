// What one node may register (checks.h kMaxNode*) and how many node ids the coordinator keeps
// (CoordinatorOptions::max_nodes): a node used to be able to add ~2 MiB to every status and any
// number of ids that were never removed (security review). Through CoordinatorCore, leases in
// simulated time (FakeClock).
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "daemon/coordinator/checks.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait here

bool Contains(const absl::Status& s, const std::string& text) { return s.message().find(text) != absl::string_view::npos; }

class NodeLimitsTest : public ::testing::Test {
 protected:
  void Make(int max_nodes) {
    CoordinatorOptions o;
    o.clock = &clock_;
    o.lease = absl::Seconds(1);
    o.max_nodes = max_nodes;
    o.make_node_client = [](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      return std::make_shared<FakeNodeClient>(node);
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
  }
  void TearDown() override {
    if (core_) core_->Shutdown();
  }
  static pb::RegisterNodeRequest Request(const std::string& node) {
    pb::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_address(absl::StrCat(node, ":1"));
    return req;
  }
  absl::Status Register(const pb::RegisterNodeRequest& req) {
    pb::RegisterNodeResponse resp;
    return core_->RegisterNode(req, &resp);
  }
  std::set<std::string> Nodes() {
    pb::StatusResponse st;
    EXPECT_TRUE(core_->ClusterStatus({}, &st).ok());
    std::set<std::string> out;
    for (const auto& n : st.nodes()) out.insert(n.node_id());
    return out;
  }
  // Simulated time in steps under a quarter lease (a longer driver gap would extend every lease).
  void Pass(absl::Duration d) {
    for (absl::Duration done; done < d; done += absl::Milliseconds(200)) {
      clock_.Advance(absl::Milliseconds(200));
      ASSERT_TRUE(core_->AwaitDriverPassAt(clock_.Now(), absl::Now() + kReal));
    }
  }
  FakeClock clock_;
  std::unique_ptr<CoordinatorCore> core_;
};

// What a real node registers (node_daemon.cc Registration(): its transport kinds, one nccl lane
// per GPU, 16-hex-digit instance ids, an address per NIC) passes with room to spare.
TEST_F(NodeLimitsTest, ARealNodesRegistrationPasses) {
  Make(4096);
  pb::RegisterNodeRequest req = Request("n0");
  auto& t = *req.mutable_transport_instances();
  for (const char* kind : {"host_tcp", "host_shm", "cuda_ipc"}) t[kind] = "0123456789abcdef";
  for (int gpu = 0; gpu < 16; ++gpu) t[absl::StrCat("nccl/", gpu)] = "0123456789abcdef";
  for (int nic = 0; nic < 8; ++nic) req.add_data_nics(absl::StrCat("10.0.", nic, ".1"));
  EXPECT_TRUE(Register(req).ok());
}

TEST_F(NodeLimitsTest, RegistrationPastEachCapIsRefusedNamingTheFieldAndLimit) {
  Make(4096);
  const std::string big(kMaxNodeEntryBytes + 1, 'x');
  const std::string fits(kMaxNodeEntryBytes, 'x');
  {
    pb::RegisterNodeRequest req = Request("n0");
    for (int i = 0; i < kMaxNodeTransportInstances; ++i) (*req.mutable_transport_instances())[absl::StrCat("k", i)] = fits;
    EXPECT_TRUE(Register(req).ok()) << "exactly at the cap";
    (*req.mutable_transport_instances())["one-more"] = "i";
    absl::Status s = Register(req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, "RegisterNode.transport_instances has 65 entries")) << s;
    EXPECT_TRUE(Contains(s, "limit of 64")) << s;
  }
  {
    pb::RegisterNodeRequest req = Request("n0");
    for (int i = 0; i < kMaxNodeDataNics; ++i) req.add_data_nics(fits);
    EXPECT_TRUE(Register(req).ok()) << "exactly at the cap";
    req.add_data_nics("10.0.0.1");
    absl::Status s = Register(req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, "RegisterNode.data_nics has 65 entries")) << s;
    EXPECT_TRUE(Contains(s, "limit of 64")) << s;
  }
  struct Case {
    const char* field;
    pb::RegisterNodeRequest req;
  };
  Case cases[3] = {{"RegisterNode.transport_instances key", Request("n0")},
                   {"RegisterNode.transport_instances value", Request("n0")},
                   {"RegisterNode.data_nics", Request("n0")}};
  (*cases[0].req.mutable_transport_instances())[big] = "i";
  (*cases[1].req.mutable_transport_instances())["host_tcp"] = big;
  cases[2].req.add_data_nics(big);
  for (const Case& c : cases) {
    absl::Status s = Register(c.req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << s;
    EXPECT_TRUE(Contains(s, absl::StrCat(c.field, " is 257 bytes, more than the limit of 256 (kMaxNodeEntryBytes)"))) << s;
    EXPECT_LT(s.message().size(), 400u) << "the value must not be echoed whole";
  }
  EXPECT_EQ(Nodes(), (std::set<std::string>{"n0"}));
}

// At max_nodes a new id is refused while every node is alive; known ids may always register again;
// a lost node (nothing refers to it: its workers went with its lease) gives its place, the one
// whose lease ran out first going first.
TEST_F(NodeLimitsTest, MaxNodesRefusesNewIdsUntilALostNodeGivesItsPlace) {
  Make(2);
  ASSERT_TRUE(Register(Request("a")).ok());
  Pass(absl::Milliseconds(200));
  ASSERT_TRUE(Register(Request("b")).ok());
  absl::Status s = Register(Request("c"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "the limit (max_nodes) is 2")) << s;
  EXPECT_TRUE(Contains(s, "none is lost")) << s;
  EXPECT_TRUE(Register(Request("b")).ok()) << "a known id is never refused";

  Pass(absl::Milliseconds(1600));  // both leases (1 s) ran out, a's first
  ASSERT_TRUE(Register(Request("c")).ok());
  EXPECT_EQ(Nodes(), (std::set<std::string>{"b", "c"}));
  ASSERT_TRUE(Register(Request("d")).ok());
  EXPECT_EQ(Nodes(), (std::set<std::string>{"c", "d"}));
  s = Register(Request("e"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "max_nodes")) << s;
  // A removed id registers afresh once there is room.
  Pass(absl::Milliseconds(1600));
  pb::RegisterNodeResponse resp;
  ASSERT_TRUE(core_->RegisterNode(Request("a"), &resp).ok());
  EXPECT_EQ(resp.incarnation(), 1u);
}

}  // namespace
}  // namespace wb::daemon

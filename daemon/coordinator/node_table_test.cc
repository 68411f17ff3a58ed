// NodeTable alone: incarnations, leases on the caller's (simulated) time, heartbeats and their
// bound, the lease sweep, drain flags and the queries. No threads, no clock: times are values.
#include "daemon/coordinator/node_table.h"

#include <memory>
#include <string>
#include <vector>

#include "daemon/coordinator/fake_node_client.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

pb::RegisterNodeRequest Req(const std::string& id, int heartbeat_ms = 100) {
  pb::RegisterNodeRequest req;
  req.set_node_id(id);
  req.set_address("addr-" + id);
  req.set_data_address("data-" + id);
  req.set_heartbeat_ms(heartbeat_ms);
  (*req.mutable_transport_instances())["host_tcp"] = "i-" + id;
  req.add_data_nics("eth0");
  return req;
}

NodeTable::Options Opts(std::string local = "") {
  NodeTable::Options o;
  o.lease = absl::Seconds(3);
  o.local_node = std::move(local);
  o.max_heartbeat_progress = 4;
  return o;
}

std::vector<std::string> SweepAt(NodeTable& t, absl::Time now, absl::Time last) {
  std::vector<std::string> lost;
  t.Sweep(now, last, [&](const std::string& id) {
    EXPECT_FALSE(t.IsAlive(id)) << id << " is reported lost before it is marked lost";
    lost.push_back(id);
  });
  return lost;
}

TEST(NodeTable, RegisterCountsIncarnationsAndReplacesTheNode) {
  NodeTable t(Opts());
  auto c1 = std::make_shared<FakeNodeClient>("n1");
  NodeTable::Registered r = t.Register(Req("n1"), c1, kT0);
  EXPECT_EQ(r.incarnation, 1u);
  EXPECT_FALSE(r.restarted);
  EXPECT_EQ(r.lease, absl::Seconds(3));
  const NodeTable::Node* n = t.Find("n1");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->address, "addr-n1");
  EXPECT_EQ(n->data_address, "data-n1");
  EXPECT_EQ(n->transport_instances.at("host_tcp"), "i-n1");
  EXPECT_EQ(n->data_nics, std::vector<std::string>{"eth0"});
  EXPECT_EQ(t.Client("n1"), c1);

  // The same id again: a new process (incarnation 2) with its new client and transports.
  auto c2 = std::make_shared<FakeNodeClient>("n1");
  pb::RegisterNodeRequest again = Req("n1");
  again.clear_transport_instances();
  again.clear_data_nics();
  r = t.Register(again, c2, kT0 + absl::Seconds(1));
  EXPECT_EQ(r.incarnation, 2u);
  EXPECT_TRUE(r.restarted);
  EXPECT_EQ(t.Client("n1"), c2);
  EXPECT_TRUE(t.Find("n1")->transport_instances.empty());
  EXPECT_TRUE(t.Find("n1")->data_nics.empty());
  EXPECT_TRUE(t.HoldsIncarnation("n1", 2));
  EXPECT_FALSE(t.HoldsIncarnation("n1", 1));
  EXPECT_EQ(t.size(), 1u);
}

TEST(NodeTable, LeaseIsAtLeastThreeHeartbeats) {
  NodeTable t(Opts());
  EXPECT_EQ(t.Register(Req("fast", 100), nullptr, kT0).lease, absl::Seconds(3));
  EXPECT_EQ(t.Register(Req("slow", 2000), nullptr, kT0).lease, absl::Seconds(6));
}

TEST(NodeTable, HeartbeatRenewsOnlyTheCurrentIncarnation) {
  NodeTable t(Opts());
  t.Register(Req("n1"), nullptr, kT0);
  auto lease = t.Heartbeat("n1", 1, kT0 + absl::Seconds(2));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(*lease, absl::Seconds(3));
  EXPECT_EQ(t.Find("n1")->lease_expiry, kT0 + absl::Seconds(5));
  // A beat received earlier than one already counted never shortens the lease.
  ASSERT_TRUE(t.Heartbeat("n1", 1, kT0 + absl::Seconds(1)).ok());
  EXPECT_EQ(t.Find("n1")->lease_expiry, kT0 + absl::Seconds(5));

  auto wrong = t.Heartbeat("n1", 7, kT0);
  EXPECT_TRUE(absl::IsNotFound(wrong.status())) << wrong.status();
  EXPECT_NE(wrong.status().message().find("node 'n1'"), std::string::npos) << wrong.status();
  EXPECT_TRUE(absl::IsNotFound(t.Heartbeat("nobody", 1, kT0).status()));
}

TEST(NodeTable, HeartbeatPayloadIsBounded) {
  NodeTable t(Opts());
  pb::HeartbeatRequest hb;
  hb.set_node_id("n1");
  for (int i = 0; i < 4; ++i) hb.add_progress();
  EXPECT_TRUE(t.CheckHeartbeat(hb).ok());
  hb.add_progress();
  absl::Status s = t.CheckHeartbeat(hb);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("max_heartbeat_progress"), std::string::npos) << s;
  EXPECT_NE(s.message().find("n1"), std::string::npos) << s;
}

TEST(NodeTable, SweepMarksExpiredNodesLostAndHeartbeatsThenFail) {
  NodeTable t(Opts());
  t.Register(Req("a"), nullptr, kT0);
  t.Register(Req("b"), nullptr, kT0 + absl::Seconds(2));
  // Sweeps every half second (no gap): a expires at kT0+3, b at kT0+5.
  absl::Time last = absl::InfinitePast();
  std::vector<std::string> lost;
  for (absl::Time now = kT0; now <= kT0 + absl::Seconds(4); now += absl::Milliseconds(500)) {
    for (const std::string& id : SweepAt(t, now, last)) lost.push_back(id);
    last = now;
  }
  EXPECT_EQ(lost, std::vector<std::string>{"a"});
  EXPECT_FALSE(t.IsAlive("a"));
  EXPECT_TRUE(t.IsAlive("b"));
  EXPECT_EQ(t.AliveClient("a"), nullptr);
  EXPECT_TRUE(absl::IsNotFound(t.Heartbeat("a", 1, kT0 + absl::Seconds(4)).status()));
  // A lost node is kept (status shows it) until it registers again.
  EXPECT_NE(t.Find("a"), nullptr);
  EXPECT_EQ(t.Register(Req("a"), nullptr, kT0 + absl::Seconds(4)).incarnation, 2u);
  EXPECT_TRUE(t.IsAlive("a"));
}

TEST(NodeTable, SweepExtendsLeasesByTheDriversOwnGap) {
  NodeTable t(Opts());
  t.Register(Req("a"), nullptr, kT0);
  // The driver last swept at kT0 and runs again 10 s later: the nodes could not be heard meanwhile.
  EXPECT_TRUE(SweepAt(t, kT0 + absl::Seconds(10), kT0).empty());
  EXPECT_EQ(t.Find("a")->lease_expiry, kT0 + absl::Seconds(13));
  // A regular pass (gap under a quarter lease) judges normally.
  EXPECT_EQ(SweepAt(t, kT0 + absl::Seconds(13), kT0 + absl::Milliseconds(12500)), std::vector<std::string>{"a"});
}

TEST(NodeTable, LocalNodeNeverExpires) {
  NodeTable t(Opts("self"));
  t.Register(Req("self"), nullptr, kT0);
  t.Register(Req("other"), nullptr, kT0);
  EXPECT_EQ(SweepAt(t, kT0 + absl::Seconds(3), kT0 + absl::Milliseconds(2900)), std::vector<std::string>{"other"});
  EXPECT_TRUE(t.IsAlive("self"));
  EXPECT_EQ(t.Find("self")->lease_expiry, kT0 + absl::Seconds(6));
}

TEST(NodeTable, DrainingPerNodeAndClearedByRegisterOrClear) {
  NodeTable t(Opts());
  t.Register(Req("a"), nullptr, kT0);
  t.Register(Req("b"), nullptr, kT0);
  EXPECT_FALSE(t.any_draining());
  EXPECT_FALSE(t.SetDraining("nobody", true));
  EXPECT_TRUE(t.SetDraining("a", true));
  EXPECT_TRUE(t.SetDraining("a", true));  // twice counts once
  EXPECT_TRUE(t.IsDraining("a"));
  EXPECT_FALSE(t.IsDraining("b"));
  EXPECT_TRUE(t.any_draining());
  EXPECT_TRUE(t.SetDraining("a", false));
  EXPECT_FALSE(t.any_draining());

  t.SetDraining("a", true);
  t.SetDraining("b", true);
  t.Register(Req("a"), nullptr, kT0);  // a new process is not draining
  EXPECT_FALSE(t.IsDraining("a"));
  EXPECT_TRUE(t.any_draining());
  t.ClearDraining();
  EXPECT_FALSE(t.IsDraining("b"));
  EXPECT_FALSE(t.any_draining());
}

TEST(NodeTable, IterationListsNodesInIdOrder) {
  NodeTable t(Opts());
  for (const char* id : {"c", "a", "b"}) t.Register(Req(id), nullptr, kT0);
  std::vector<std::string> ids;
  for (const auto& [id, n] : t) ids.push_back(id);
  EXPECT_EQ(ids, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(t.Find("zz"), nullptr);
  EXPECT_EQ(t.Find("b")->address, "addr-b");
  EXPECT_EQ(t.Client("zz"), nullptr);
  EXPECT_FALSE(t.IsAlive("zz"));
}

// The queries the driver and the catch-up use in place of map lookups: the client whether or not
// the node is alive (commits, aborts), only while alive (installs), and the incarnation a commit
// is recorded against (0 for an unknown node, which no node ever holds).
TEST(NodeTable, QueriesForTheDriverAndTheCatchUp) {
  NodeTable t(Opts());
  auto ca = std::make_shared<FakeNodeClient>("a");
  t.Register(Req("a"), ca, kT0);
  t.Register(Req("b"), nullptr, kT0 + absl::Seconds(2));
  EXPECT_EQ(t.Incarnation("a"), 1u);
  EXPECT_EQ(t.Incarnation("zz"), 0u);
  EXPECT_FALSE(t.HoldsIncarnation("zz", t.Incarnation("zz")));
  EXPECT_EQ(SweepAt(t, kT0 + absl::Seconds(3), kT0 + absl::Milliseconds(2900)), std::vector<std::string>{"a"});
  // Lost: the client stays reachable by Client (an abort is best effort), not by AliveClient, and
  // the incarnation it had is no longer held.
  EXPECT_EQ(t.Client("a"), ca);
  EXPECT_EQ(t.AliveClient("a"), nullptr);
  EXPECT_EQ(t.Incarnation("a"), 1u);
  EXPECT_FALSE(t.HoldsIncarnation("a", 1));
  EXPECT_TRUE(t.IsAlive("b"));
  t.Register(Req("a"), ca, kT0 + absl::Seconds(4));
  EXPECT_EQ(t.Incarnation("a"), 2u);
  EXPECT_EQ(t.AliveClient("a"), ca);
  EXPECT_TRUE(t.HoldsIncarnation("a", 2));
}

}  // namespace
}  // namespace wb::daemon

// End-to-end: host_tcp multi-NIC striping (user ask 9) with real daemons and workers on loopback.
// Two node daemons with two data NICs each (--data_nics; 127.0.0.1/.2 on n0, 127.0.0.3/.4 on n1,
// all on Linux loopback without configuration, and distinct, so every counter says which side's
// address it is), a Megatron trainer on n0, a vLLM rollout on n1: several versions cross over
// host_tcp and the rollout checks every byte. The nodes' wb_nic_bytes_total then shows payload on
// BOTH local NICs of each side, on the rail-aligned pairs (.1 <-> .3, .2 <-> .4) and nowhere else,
// summing to what wb_bytes_total says crossed; `wbctl status` lists the NICs. A NIC address this
// host does not have (or an unknown interface) stops the daemon at startup with exit 2 naming it.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

const std::vector<std::string> kN0Nics = {"127.0.0.1", "127.0.0.2"};
const std::vector<std::string> kN1Nics = {"127.0.0.3", "127.0.0.4"};

// Sum of `name`'s series whose text contains every one of `labels` (prometheus-cpp prints labels
// sorted by name, so they are matched one by one).
double Sum(const std::map<std::string, double>& m, const std::string& name, const std::vector<std::string>& labels) {
  double sum = 0;
  for (auto& [k, v] : m) {
    if (k.rfind(name + "{", 0) != 0) continue;
    bool all = true;
    for (const std::string& l : labels) all = all && absl::StrContains(k, l);
    if (all) sum += v;
  }
  return sum;
}

std::string Label(const std::string& name, const std::string& value) { return absl::StrCat(name, "=\"", value, "\""); }

TEST(MultiNicTest, VersionsCrossOverBothNicsOfEachNode) {
  auto harness = Harness::Create("multinic");
  ASSERT_TRUE(harness.ok()) << harness.status();
  ClusterOptions options;
  options.num_nodes = 2;
  options.node_metrics = true;
  // 4 streams (the default) over 2 NICs: streams 0 and 2 on NIC 0, 1 and 3 on NIC 1.
  options.node_flags[0] = {"--data_nics=" + kN0Nics[0] + "," + kN0Nics[1], "--tcp_streams=4"};
  options.node_flags[1] = {"--data_nics=" + kN1Nics[0] + "," + kN1Nics[1], "--tcp_streams=4"};
  auto cluster = Cluster::Start(harness->get(), options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& cl = **cluster;

  // The coordinator knows each node's NICs and their listening ports (NodeStatus.data_nics,
  // "host:port"), and wbctl shows them.
  auto status = cl.Status();
  ASSERT_TRUE(status.ok()) << status.status();
  std::map<std::string, std::vector<std::string>> nics;
  for (const auto& n : status->nodes()) {
    for (const std::string& e : n.data_nics()) {
      const size_t colon = e.rfind(':');
      int port = 0;
      ASSERT_NE(colon, std::string::npos) << e << ": no port";
      EXPECT_TRUE(absl::SimpleAtoi(e.substr(colon + 1), &port) && port > 0 && port < 65536) << e;
      nics[n.node_id()].push_back(e.substr(0, colon));
    }
  }
  EXPECT_EQ(nics["n0"], kN0Nics);
  EXPECT_EQ(nics["n1"], kN1Nics);
  std::vector<std::string> lines;
  auto code = cl.RunWbctl({"status", "--addr", cl.coordinator_address()}, Scaled(absl::Seconds(30)), &lines);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  bool shown = false;
  for (const std::string& l : lines) shown = shown || (absl::StrContains(l, "host_tcp[127.0.0.3:") && absl::StrContains(l, ",127.0.0.4:"));
  EXPECT_TRUE(shown) << "wbctl status does not list n1's NICs";

  RunOptions run;
  run.config = ModelConfigPath();
  run.model_id = "qwen-multinic";
  run.mode = "sync";
  run.versions = 3;
  const std::vector<WorkerSpec> trainers = {{true, 0, "megatron", 1, 1, 1, 1, 0, 0}};
  const std::vector<WorkerSpec> rollouts = {{false, 1, "vllm", 1, 1, 1, 1, 0, 0}};
  auto result = cl.RunWorkers(run, trainers, rollouts);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const absl::Status& s : result->failures) ADD_FAILURE() << s;
  if (HasFailure()) {
    for (int n = 0; n < 2; ++n) ADD_FAILURE() << "node n" << n << " log:\n" << cl.node(n)->LogTail();
    return;
  }
  Process* rollout = result->rollouts[0];
  EXPECT_TRUE(EventsNamed(rollout, "mismatch").empty()) << rollout->LogTail();
  auto applied = EventsNamed(rollout, "applied");
  ASSERT_EQ(applied.size(), 3u) << rollout->LogTail();
  EXPECT_EQ(applied.back()["version"].get<uint64_t>(), 3u);
  for (uint64_t v = 1; v <= 3; ++v) EXPECT_GT(VerifiedBytes(rollout, v), 0) << "version " << v;

  auto m0 = daemon::ScrapeMetrics(cl.node_metrics_port(0), absl::Seconds(10));
  auto m1 = daemon::ScrapeMetrics(cl.node_metrics_port(1), absl::Seconds(10));
  ASSERT_TRUE(m0.ok()) << m0.status();
  ASSERT_TRUE(m1.ok()) << m1.status();
  const std::string nic = "wb_nic_bytes_total";
  // What crossed, by the daemons' own route accounting (every op's bytes, per completed batch).
  const double crossed = Sum(*m0, "wb_bytes_total", {Label("node", "n0"), Label("route", "host_tcp"), Label("peer", "n1")});
  ASSERT_GT(crossed, 0);
  EXPECT_EQ(Sum(*m1, "wb_bytes_total", {Label("node", "n1"), Label("route", "host_tcp"), Label("peer", "n0")}), crossed);
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE(absl::StrCat("rail ", k, ": ", kN0Nics[k], " <-> ", kN1Nics[k]));
    const double sent = Sum(*m0, nic, {Label("node", "n0"), Label("nic", kN0Nics[k]), Label("peer", "n1"),
                                       Label("peer_nic", kN1Nics[k]), Label("direction", "sent")});
    const double received = Sum(*m1, nic, {Label("node", "n1"), Label("nic", kN1Nics[k]), Label("peer", "n0"),
                                           Label("peer_nic", kN0Nics[k]), Label("direction", "received")});
    // Both NICs of each side carried a real share (chunks of 1 MiB pulled by 2 streams per NIC).
    EXPECT_GT(sent, crossed / 10) << "n0 NIC " << kN0Nics[k] << " sent too little of " << crossed;
    EXPECT_EQ(received, sent) << "n1 NIC " << kN1Nics[k] << " received a different amount than its rail sent";
    std::printf("rail %s -> %s: %.0f of %.0f bytes\n", kN0Nics[k].c_str(), kN1Nics[k].c_str(), sent, crossed);
  }
  // Every payload byte is on a rail, in the direction of the transfer, and no byte is missing.
  EXPECT_EQ(Sum(*m0, nic, {Label("node", "n0"), Label("direction", "sent")}), crossed);
  EXPECT_EQ(Sum(*m1, nic, {Label("node", "n1"), Label("direction", "received")}), crossed);
  EXPECT_EQ(Sum(*m0, nic, {Label("direction", "received")}), 0);
  EXPECT_EQ(Sum(*m1, nic, {Label("direction", "sent")}), 0);
  EXPECT_EQ(Sum(*m0, nic, {Label("nic", kN0Nics[0]), Label("peer_nic", kN1Nics[1])}) +
                Sum(*m0, nic, {Label("nic", kN0Nics[1]), Label("peer_nic", kN1Nics[0])}),
            0)
      << "bytes off the rails";
}

// A configured NIC this host cannot use fails the daemon at startup, naming it: no silent
// fallback to the NICs that work.
TEST(MultiNicTest, UnusableNicStopsTheDaemonNamingIt) {
  auto harness = Harness::Create("multinic-bad");
  ASSERT_TRUE(harness.ok()) << harness.status();
  struct Case {
    std::string nics;
    std::vector<std::string> says;
  };
  const Case cases[] = {
      // TEST-NET-1: an address no interface of this host has.
      {"127.0.0.1,192.0.2.1", {"data NIC 192.0.2.1 cannot be used", "Cannot assign requested address",
                               "no interface of this host has that address"}},
      {"127.0.0.1,no-such-nic0", {"--data_nics", "no-such-nic0", "interfaces with IPv4"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.nics);
    ++i;
    std::vector<std::string> argv = {Runfile("daemon/weightbridged"),
                                     "--role=node",
                                     "--listen=127.0.0.1:0",
                                     "--worker_socket=" + (*harness)->Path(absl::StrCat("bad", i, ".sock")),
                                     // Never reached: the transports are created before registering.
                                     "--coordinator=127.0.0.1:1",
                                     "--node_id=bad" + std::to_string(i),
                                     "--data_nics=" + c.nics};
    auto p = (*harness)->Spawn(absl::StrCat("bad", i), argv);
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->WaitExit(Scaled(absl::Seconds(30)));
    ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*p)->LogTail();
    EXPECT_EQ(*code, 2) << (*p)->LogTail();
    const std::string log = (*p)->LogTail();
    for (const std::string& s : c.says) EXPECT_TRUE(absl::StrContains(log, s)) << "missing '" << s << "' in:\n" << log;
  }
}

// A bad egress cap (--max_send_gbps: negative, not a number) stops the daemon at startup naming
// the flag, rather than running uncapped or never sending.
TEST(MultiNicTest, BadEgressCapStopsTheDaemonNamingIt) {
  auto harness = Harness::Create("egress-cap-bad");
  ASSERT_TRUE(harness.ok()) << harness.status();
  int i = 0;
  for (const std::string cap : {"-5", "inf"}) {
    SCOPED_TRACE(cap);
    ++i;
    std::vector<std::string> argv = {Runfile("daemon/weightbridged"),
                                     "--role=node",
                                     "--listen=127.0.0.1:0",
                                     "--worker_socket=" + (*harness)->Path(absl::StrCat("cap", i, ".sock")),
                                     "--coordinator=127.0.0.1:1",
                                     "--node_id=cap" + std::to_string(i),
                                     "--max_send_gbps=" + cap};
    auto p = (*harness)->Spawn(absl::StrCat("cap", i), argv);
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->WaitExit(Scaled(absl::Seconds(30)));
    ASSERT_TRUE(code.ok()) << code.status() << "\n" << (*p)->LogTail();
    EXPECT_EQ(*code, 2) << (*p)->LogTail();
    EXPECT_TRUE(absl::StrContains((*p)->LogTail(), "--max_send_gbps must be a finite number >= 0")) << (*p)->LogTail();
  }
}

}  // namespace
}  // namespace wb::e2e

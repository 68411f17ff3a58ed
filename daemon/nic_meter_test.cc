// NicMeter turns cumulative per-path counts into wb_nic_bytes_total increments; scraped over HTTP
// from a private DaemonMetrics registry.
#include "daemon/nic_meter.h"

#include <map>
#include <string>

#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

transport::PathStats Path(const std::string& inst, const std::string& local, const std::string& remote, int64_t sent,
                          int64_t received) {
  transport::PathStats p;
  p.peer_instance = inst;
  p.local_address = local;
  p.remote_address = remote;
  p.bytes_sent = sent;
  p.bytes_received = received;
  return p;
}

std::string Series(const std::string& nic, const std::string& peer, const std::string& peer_nic, const std::string& dir) {
  // prometheus-cpp prints labels sorted by name.
  return "wb_nic_bytes_total{direction=\"" + dir + "\",nic=\"" + nic + "\",node=\"n0\",peer=\"" + peer +
         "\",peer_nic=\"" + peer_nic + "\"}";
}

TEST(NicMeterTest, RecordsGrowthPerPathOnceAndWaitsForUnknownPeers) {
  DaemonMetrics m;
  auto ep = MetricsEndpoint::Start("127.0.0.1:0", m.registry());
  ASSERT_TRUE(ep.ok()) << ep.status();
  NicMeter meter;
  const std::map<std::string, std::string> known = {{"inst-n1", "n1"}};

  meter.Record(m, "n0",
               {Path("inst-n1", "10.0.0.5", "10.0.0.6", 1000, 0), Path("inst-n1", "10.0.1.5", "10.0.1.6", 3000, 7),
                Path("inst-n2", "10.0.0.5", "10.0.0.7", 500, 0)},
               known);
  auto first = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(MetricValue(*first, Series("10.0.0.5", "n1", "10.0.0.6", "sent")), 1000);
  EXPECT_EQ(MetricValue(*first, Series("10.0.1.5", "n1", "10.0.1.6", "sent")), 3000);
  EXPECT_EQ(MetricValue(*first, Series("10.0.1.5", "n1", "10.0.1.6", "received")), 7);
  EXPECT_EQ(MetricValue(*first, Series("10.0.0.5", "n1", "10.0.0.6", "received")), -1) << "no bytes, no series";
  EXPECT_EQ(MetricSum(*first, "wb_nic_bytes_total", "10.0.0.7"), 0) << "peer instance unknown yet: pending";

  // Growth only; an older snapshot (a concurrent caller's) adds nothing; the pending path's whole
  // count lands once its peer is known.
  meter.Record(m, "n0", {Path("inst-n1", "10.0.0.5", "10.0.0.6", 1500, 0), Path("inst-n2", "10.0.0.5", "10.0.0.7", 600, 0)},
               {{"inst-n1", "n1"}, {"inst-n2", "n2"}});
  meter.Record(m, "n0", {Path("inst-n1", "10.0.0.5", "10.0.0.6", 1200, 0)}, known);
  meter.Record(m, "n0", {Path("inst-n1", "10.0.1.5", "10.0.1.6", 3000, 7)}, known);
  auto second = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(MetricValue(*second, Series("10.0.0.5", "n1", "10.0.0.6", "sent")), 1500);
  EXPECT_EQ(MetricValue(*second, Series("10.0.1.5", "n1", "10.0.1.6", "sent")), 3000);
  EXPECT_EQ(MetricValue(*second, Series("10.0.1.5", "n1", "10.0.1.6", "received")), 7);
  EXPECT_EQ(MetricValue(*second, Series("10.0.0.5", "n2", "10.0.0.7", "sent")), 600);
}

}  // namespace
}  // namespace wb::daemon

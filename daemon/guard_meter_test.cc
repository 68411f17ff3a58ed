// GuardMeter turns the transports' cumulative bound counts into wb_transport_guard_events_total
// increments and their held counts into wb_transport_guard_held; scraped over HTTP from a private
// DaemonMetrics registry.
#include "daemon/guard_meter.h"

#include <string>

#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

transport::GuardCount Event(const std::string& name, int64_t value) { return {name, value, true}; }
transport::GuardCount Held(const std::string& name, int64_t value) { return {name, value, false}; }

std::string Series(const std::string& family, const std::string& transport, const std::string& what) {
  // prometheus-cpp prints labels sorted by name.
  return family + "{node=\"n0\",transport=\"" + transport + "\",what=\"" + what + "\"}";
}

TEST(GuardMeterTest, RecordsGrowthOnceAndSetsHeldCounts) {
  DaemonMetrics m;
  auto ep = MetricsEndpoint::Start("127.0.0.1:0", m.registry());
  ASSERT_TRUE(ep.ok()) << ep.status();
  GuardMeter meter;
  const std::string events = "wb_transport_guard_events_total", held = "wb_transport_guard_held";

  meter.Record(m, "n0", "host_tcp", {Event("hellos_refused", 3), Event("parked_refused", 0), Held("parked_connections", 7)});
  auto first = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(MetricValue(*first, Series(events, "host_tcp", "hellos_refused")), 3);
  EXPECT_EQ(MetricValue(*first, Series(events, "host_tcp", "parked_refused")), -1) << "no event, no series";
  EXPECT_EQ(MetricValue(*first, Series(held, "host_tcp", "parked_connections")), 7);

  // Growth only: the same count again adds nothing, an older (smaller) snapshot adds nothing, a
  // held count goes down as well as up; another transport label counts on its own.
  meter.Record(m, "n0", "host_tcp", {Event("hellos_refused", 3), Held("parked_connections", 2)});
  meter.Record(m, "n0", "host_tcp", {Event("hellos_refused", 5), Event("parked_refused", 4)});
  meter.Record(m, "n0", "host_tcp", {Event("hellos_refused", 4)});
  meter.Record(m, "n0", "other", {Event("hellos_refused", 1)});
  auto second = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(MetricValue(*second, Series(events, "host_tcp", "hellos_refused")), 5);
  EXPECT_EQ(MetricValue(*second, Series(events, "host_tcp", "parked_refused")), 4);
  EXPECT_EQ(MetricValue(*second, Series(events, "other", "hellos_refused")), 1);
  EXPECT_EQ(MetricValue(*second, Series(held, "host_tcp", "parked_connections")), 2);
}

}  // namespace
}  // namespace wb::daemon

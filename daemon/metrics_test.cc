// The metrics endpoint is prometheus-cpp's Exposer on 127.0.0.1:0; scraped over real HTTP.
#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

TEST(MetricsTest, EndpointServesRecordedValuesAndTheyChange) {
  DaemonMetrics m;
  auto ep = MetricsEndpoint::Start("127.0.0.1:0", m.registry());
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_GT((*ep)->port(), 0);

  m.Version("n0", "qwen", "committed");
  m.Bytes("n0", "qwen", "tcp", "n1", 1000);
  m.Phase("n0", "transfer", 0.5);
  m.Link("n0", "n1", 2'000'000'000, 0.5);
  m.Failure("n0", absl::DeadlineExceededError("version 3 did not arrive in time"));
  m.Applied("n0", "qwen", "r0", 3, 5);
  auto first = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(MetricValue(*first, "wb_versions_total{event=\"committed\",model=\"qwen\",node=\"n0\"}"), 1);
  EXPECT_EQ(MetricValue(*first, "wb_bytes_total{model=\"qwen\",node=\"n0\",peer=\"n1\",route=\"tcp\"}"), 1000);
  EXPECT_EQ(MetricValue(*first, "wb_phase_seconds_count{node=\"n0\",phase=\"transfer\"}"), 1);
  EXPECT_DOUBLE_EQ(MetricValue(*first, "wb_link_gbps{node=\"n0\",peer=\"n1\"}"), 4.0);
  EXPECT_EQ(MetricValue(*first, "wb_failures_total{node=\"n0\",reason=\"timeout\"}"), 1);
  EXPECT_EQ(MetricValue(*first, "wb_staleness_versions{model=\"qwen\",node=\"n0\",worker=\"r0\"}"), 2);

  m.Version("n0", "qwen", "committed");
  m.Bytes("n0", "qwen", "tcp", "n1", 24);
  m.Applied("n0", "qwen", "r0", 5, 5);
  auto second = ScrapeMetrics((*ep)->port(), absl::Seconds(10));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(MetricValue(*second, "wb_versions_total{event=\"committed\",model=\"qwen\",node=\"n0\"}"), 2);
  EXPECT_EQ(MetricValue(*second, "wb_bytes_total{model=\"qwen\",node=\"n0\",peer=\"n1\",route=\"tcp\"}"), 1024);
  EXPECT_EQ(MetricValue(*second, "wb_staleness_versions{model=\"qwen\",node=\"n0\",worker=\"r0\"}"), 0);
}

TEST(MetricsTest, BusyPortIsUnavailableNotACrash) {
  DaemonMetrics m;
  auto a = MetricsEndpoint::Start("127.0.0.1:0", m.registry());
  ASSERT_TRUE(a.ok());
  auto b = MetricsEndpoint::Start(absl::StrCat("127.0.0.1:", (*a)->port()), m.registry());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
}

// A few silent connections (a port scanner, a stuck client, a half-open scrape) must not stop
// Prometheus from scraping: before, the endpoint had one HTTP thread, which a single connection
// that sent nothing held until civetweb's 30 s request timeout (and a client sending a byte now
// and then, for good).
TEST(MetricsTest, SilentConnectionsDoNotBlockAScrape) {
  DaemonMetrics m;
  m.Version("n0", "qwen", "committed");
  auto ep = MetricsEndpoint::Start("127.0.0.1:0", m.registry());
  ASSERT_TRUE(ep.ok()) << ep.status();
  std::vector<int> silent;
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>((*ep)->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    if (i % 2 == 1) {
      ASSERT_EQ(::send(fd, "GET /met", 8, 0), 8);  // a request that never ends
    }
    silent.push_back(fd);
  }
  auto scrape = ScrapeMetrics((*ep)->port(), absl::Seconds(5));
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(MetricValue(*scrape, "wb_versions_total{event=\"committed\",model=\"qwen\",node=\"n0\"}"), 1);
  for (int fd : silent) ::close(fd);
}

TEST(MetricsTest, FailureReasonsAreAFixedVocabulary) {
  EXPECT_EQ(FailureReason(absl::DataLossError("checksum mismatch on op 3")), "checksum");
  EXPECT_EQ(FailureReason(absl::AbortedError("node n1 restarted")), "restarted");
  EXPECT_EQ(FailureReason(absl::AbortedError("node n1 lost its lease")), "node_lost");
  EXPECT_EQ(FailureReason(absl::AbortedError("worker r0 deregistered")), "worker_left");
  EXPECT_EQ(FailureReason(absl::DeadlineExceededError("x")), "timeout");
  EXPECT_EQ(FailureReason(absl::UnavailableError("node n0 -> node n1: connection reset")), "send");
  EXPECT_EQ(FailureReason(absl::InternalError("??")), "other");
}

}  // namespace
}  // namespace wb::daemon

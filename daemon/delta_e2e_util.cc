#include "daemon/delta_e2e_util.h"

#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"

namespace wb::daemon {

DeltaMeter ScrapeDeltaMeter(int port) {
  auto m = ScrapeMetrics(port, absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  DeltaMeter out;
  if (!m.ok()) return out;
  out.stream = MetricSum(*m, "wb_delta_bytes_total", "kind=\"stream\"");
  out.replaced = MetricSum(*m, "wb_delta_bytes_total", "kind=\"replaced\"");
  out.full = MetricSum(*m, "wb_delta_bytes_total", "kind=\"full\"");
  out.fallbacks = MetricSum(*m, "wb_delta_fallbacks_total", "");
  out.digest_transport = MetricSum(*m, "wb_digest_bytes_total", "how=\"transport\"");
  out.digest_codec = MetricSum(*m, "wb_digest_bytes_total", "how=\"codec\"");
  out.digest_memory = MetricSum(*m, "wb_digest_bytes_total", "how=\"memory\"");
  out.decoded_in_place = MetricSum(*m, "wb_delta_decoded_total", "how=\"in_place\"");
  out.decoded_copied = MetricSum(*m, "wb_delta_decoded_total", "how=\"copied\"");
  return out;
}

pb::VersionStatus FinalVersionStatus(Cluster& c, uint64_t v) {
  auto st = c.WaitForCoordinator(
      [v](const pb::StatusResponse& s) {
        for (const pb::VersionStatus& vs : s.versions()) {
          if (vs.version() == v && vs.state() != "queued" && vs.state() != "transferring" && vs.state() != "published") return true;
        }
        return false;
      },
      absl::Seconds(30));
  EXPECT_TRUE(st.ok()) << st.status();
  if (st.ok()) {
    for (const pb::VersionStatus& vs : st->versions()) {
      if (vs.version() == v) return vs;
    }
  }
  return {};
}

}  // namespace wb::daemon

#pragma once
// Test helper: GET /metrics from 127.0.0.1:<port> over a plain socket (a scraper's view), and
// look up one sample by its exact series text (name{labels sorted as prometheus-cpp prints them}).

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wb::daemon {

// series text -> value, from the Prometheus text format.
absl::StatusOr<std::map<std::string, double>> ScrapeMetrics(int port, absl::Duration timeout);
// The value, or -1 when the series is absent.
double MetricValue(const std::map<std::string, double>& samples, const std::string& series);
// Sum over every series whose text starts with `prefix` (e.g. a name and some labels).
double MetricSum(const std::map<std::string, double>& samples, const std::string& name, const std::string& must_contain = "");

}  // namespace wb::daemon

// Shared by the lossless-delta end-to-end tests with real daemons (delta_e2e_test, delta_relay_e2e_test,
// delta_quant_e2e_test): the node metrics that say what travelled as deltas, and the coordinator's
// final record of a version.
#pragma once

#include <cstdint>

#include "daemon/multinode_fixture.h"

namespace wb::daemon {

// Sums over every node of this process (the metrics registry is process-wide).
struct DeltaMeter {
  double stream = 0, replaced = 0, full = 0, fallbacks = 0;
  // wb_digest_bytes_total{how=transport|codec|memory}: where the end-to-end digests were hashed.
  double digest_transport = 0, digest_codec = 0, digest_memory = 0;
  // wb_delta_decoded_total{how=in_place|copied}.
  double decoded_in_place = 0, decoded_copied = 0;
};
// wb_delta_bytes_total{kind=stream|replaced|full} and wb_delta_fallbacks_total, scraped from the
// metrics endpoint on `port` (a test failure when it does not answer).
DeltaMeter ScrapeDeltaMeter(int port);

// The coordinator's record of version v of model "m" once it left queued / transferring /
// published (waits up to 30 s; an empty record and a test failure otherwise).
pb::VersionStatus FinalVersionStatus(Cluster& c, uint64_t v);

}  // namespace wb::daemon

#pragma once
// TEST ONLY: the parts of one node daemon ("n0") that node::Versions runs over, built the way
// NodeDaemon wires them but on a FakeClock, host_shm and (optionally) the in-process fake
// transport posing as host_tcp: the common base of daemon/node versions_test and
// worker_calls_test (each adds its own coordinator seam and what it tests on top).

#include <memory>

#include "base/clock.h"
#include "daemon/metrics.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/node/versions.h"
#include "transport/factory.h"
#include "transport/testing/fake_transport.h"

namespace wb::daemon::testing {

class NodeParts {
 protected:
  struct Options {
    bool fake_host_tcp = false;     // also a fake "host_tcp" transport on fabric_
    int64_t staging_budget_bytes = 0;  // 0: NodeStaging's default
  };
  explicit NodeParts(Options o);
  // A derived fixture's destructor resets versions_ (and whatever it built over it) while its
  // coordinator still exists; this destructor then drops the rest.
  virtual ~NodeParts();

  // node::Versions over these parts and `coordinator` (the derived fixture's member, so built
  // after this base).
  void MakeVersions(node::CoordinatorAccess& coordinator);

  FakeClock clock_;
  DaemonMetrics metrics_;
  transport::testing::FakeFabric fabric_;
  transport::TransportSet set_;
  std::unique_ptr<LiveCopier> copier_;
  std::unique_ptr<LocalWorkers> local_;
  std::unique_ptr<node::NodeStaging> staging_;
  node::ChannelCache channels_;
  std::unique_ptr<node::NodeTransports> transports_;
  std::unique_ptr<node::Versions> versions_;
};

}  // namespace wb::daemon::testing

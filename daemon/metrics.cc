#include "daemon/metrics.h"

#include <algorithm>

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <exception>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace wb::daemon {

struct DaemonMetrics::Families {
  prometheus::Family<prometheus::Counter>* versions;
  prometheus::Family<prometheus::Counter>* bytes;
  prometheus::Family<prometheus::Histogram>* phase;
  prometheus::Family<prometheus::Counter>* staged;
  prometheus::Family<prometheus::Counter>* nccl_lane;
  prometheus::Family<prometheus::Counter>* nccl_bounce;
  prometheus::Family<prometheus::Counter>* nic;
  prometheus::Family<prometheus::Counter>* quantized;
  prometheus::Family<prometheus::Gauge>* link;
  prometheus::Family<prometheus::Counter>* failures;
  prometheus::Family<prometheus::Counter>* rejected;
  prometheus::Family<prometheus::Gauge>* staleness;
  prometheus::Family<prometheus::Gauge>* committed;
  prometheus::Family<prometheus::Gauge>* applied;
  prometheus::Family<prometheus::Counter>* staging;
  prometheus::Family<prometheus::Gauge>* staging_pool;
  prometheus::Family<prometheus::Counter>* relay_at_commit;
  prometheus::Family<prometheus::Gauge>* delta_cache;
  prometheus::Family<prometheus::Counter>* delta_bytes;
  prometheus::Family<prometheus::Counter>* delta_fallbacks;
  prometheus::Family<prometheus::Counter>* delta_decoded;
  prometheus::Family<prometheus::Counter>* digest_bytes;
  prometheus::Family<prometheus::Counter>* guard_events;
  prometheus::Family<prometheus::Gauge>* guard_held;
};

DaemonMetrics::DaemonMetrics() : registry_(std::make_shared<prometheus::Registry>()), f_(std::make_unique<Families>()) {
  prometheus::Registry& r = *registry_;
  f_->versions = &prometheus::BuildCounter().Name("wb_versions_total").Help("Versions by event (published, committed, aborted, applied)").Register(r);
  f_->bytes = &prometheus::BuildCounter().Name("wb_bytes_total").Help("Bytes moved by this node, per route and peer node").Register(r);
  f_->phase = &prometheus::BuildHistogram().Name("wb_phase_seconds").Help("Seconds per phase (snapshot, transfer, commit, apply)").Register(r);
  f_->staged = &prometheus::BuildCounter().Name("wb_cuda_staged_bytes_total").Help("Staging allocated for CUDA buffers, on the GPU (GPU-direct) or in host memory").Register(r);
  f_->nccl_lane = &prometheus::BuildCounter().Name("wb_nccl_lane_bytes_total").Help("Bytes moved over nccl per lane pair (this node's GPU, the peer's GPU)").Register(r);
  f_->nccl_bounce = &prometheus::BuildCounter().Name("wb_nccl_bounce_bytes_total").Help("nccl sources first copied to their lane's GPU (not already GPU staging there)").Register(r);
  f_->nic = &prometheus::BuildCounter().Name("wb_nic_bytes_total").Help("host_tcp payload bytes per local address (data NIC), peer node and peer address, sent or received").Register(r);
  f_->quantized = &prometheus::BuildCounter().Name("wb_quantized_bytes_total").Help("Canonical bytes of quantised rollout pieces quantised on this node").Register(r);
  f_->link = &prometheus::BuildGauge().Name("wb_link_gbps").Help("GB/s of the newest transfer towards a peer node").Register(r);
  f_->failures = &prometheus::BuildCounter().Name("wb_failures_total").Help("Failed or aborted transfers by reason").Register(r);
  f_->rejected = &prometheus::BuildCounter().Name("wb_rejected_total").Help("Requests refused by authentication or limits").Register(r);
  f_->staleness = &prometheus::BuildGauge().Name("wb_staleness_versions").Help("Committed minus applied version of a rollout worker").Register(r);
  f_->committed = &prometheus::BuildGauge().Name("wb_committed_version").Help("Newest committed version").Register(r);
  f_->applied = &prometheus::BuildGauge().Name("wb_applied_version").Help("Newest version applied by a rollout worker").Register(r);
  f_->staging = &prometheus::BuildCounter().Name("wb_staging_bytes_total").Help("Host staging taken for versions: reused from the staging pool or newly allocated").Register(r);
  f_->staging_pool = &prometheus::BuildGauge().Name("wb_staging_pool_bytes").Help("Idle host staging kept for the next version").Register(r);
  f_->relay_at_commit = &prometheus::BuildCounter().Name("wb_relay_at_commit_bytes_total").Help("Same-node relays a sync commit copied straight into live weights").Register(r);
  f_->delta_cache = &prometheus::BuildGauge().Name("wb_delta_cache_bytes").Help("Host memory of the sender's copies of what destinations committed (deltas)").Register(r);
  f_->delta_bytes = &prometheus::BuildCounter().Name("wb_delta_bytes_total").Help("Delta ops sent: streams, the raw bytes they replaced, ops sent in full").Register(r);
  f_->digest_bytes = &prometheus::BuildCounter().Name("wb_digest_bytes_total").Help("Bytes of boxes digested end to end, by where they were hashed: transport, codec, memory").Register(r);
  f_->delta_fallbacks = &prometheus::BuildCounter().Name("wb_delta_fallbacks_total").Help("Deltas refused here (base mismatch, corrupt) and resent in full").Register(r);
  f_->guard_events = &prometheus::BuildCounter().Name("wb_transport_guard_events_total").Help("A transport's bounds against its peers acting (host_tcp: hellos refused, parked connections refused or expired, channels closed for early control frames)").Register(r);
  f_->guard_held = &prometheus::BuildGauge().Name("wb_transport_guard_held").Help("What a transport's peers make it hold now (host_tcp: parked connections, early control frames)").Register(r);
  f_->delta_decoded = &prometheus::BuildCounter().Name("wb_delta_decoded_total").Help("Delta ops decoded here: in place (staging still held the base) or copied (base copied from committed staging or live weights)").Register(r);
}

DaemonMetrics::~DaemonMetrics() = default;

void DaemonMetrics::Version(const std::string& node, const std::string& model, const std::string& event) {
  f_->versions->Add({{"node", node}, {"model", model}, {"event", event}}).Increment();
}

void DaemonMetrics::Bytes(const std::string& node, const std::string& model, const std::string& route,
                          const std::string& peer, uint64_t bytes) {
  f_->bytes->Add({{"node", node}, {"model", model}, {"route", route}, {"peer", peer}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::Staged(const std::string& node, const std::string& memory, const std::string& what, uint64_t bytes) {
  f_->staged->Add({{"node", node}, {"memory", memory}, {"what", what}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::NcclLane(const std::string& node, const std::string& peer, int gpu, int peer_gpu, uint64_t bytes) {
  f_->nccl_lane->Add({{"node", node}, {"peer", peer}, {"gpu", absl::StrCat(gpu)}, {"peer_gpu", absl::StrCat(peer_gpu)}})
      .Increment(static_cast<double>(bytes));
}

void DaemonMetrics::NcclBounce(const std::string& node, uint64_t bytes) {
  f_->nccl_bounce->Add({{"node", node}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::NicBytes(const std::string& node, const std::string& nic, const std::string& peer,
                             const std::string& peer_nic, const std::string& direction, uint64_t bytes) {
  f_->nic->Add({{"node", node}, {"nic", nic}, {"peer", peer}, {"peer_nic", peer_nic}, {"direction", direction}})
      .Increment(static_cast<double>(bytes));
}

void DaemonMetrics::Quantized(const std::string& node, uint64_t bytes, double seconds) {
  f_->quantized->Add({{"node", node}}).Increment(static_cast<double>(bytes));
  Phase(node, "quantize", seconds);
}

void DaemonMetrics::Phase(const std::string& node, const std::string& phase, double seconds) {
  // 100 us .. ~100 s, x4 per bucket: covers a tiny test copy and a Kimi-K2-scale transfer.
  static const auto* bounds = new prometheus::Histogram::BucketBoundaries{1e-4, 4e-4, 1.6e-3, 6.4e-3, 0.0256, 0.1024,
                                                                         0.4096, 1.6384, 6.5536, 26.2144, 104.8576};
  f_->phase->Add({{"node", node}, {"phase", phase}}, *bounds).Observe(seconds);
}

void DaemonMetrics::Link(const std::string& node, const std::string& peer, uint64_t bytes, double seconds) {
  if (seconds <= 0) return;
  f_->link->Add({{"node", node}, {"peer", peer}}).Set(static_cast<double>(bytes) / seconds / 1e9);
}

void DaemonMetrics::StagingTaken(const std::string& node, bool reused, uint64_t bytes) {
  f_->staging->Add({{"node", node}, {"result", reused ? "reused" : "allocated"}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::StagingPoolBytes(const std::string& node, int64_t idle_bytes) {
  f_->staging_pool->Add({{"node", node}}).Set(static_cast<double>(idle_bytes));
}

void DaemonMetrics::RelayAtCommit(const std::string& node, uint64_t bytes) {
  f_->relay_at_commit->Add({{"node", node}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::Deltas(const std::string& node, uint64_t cache_bytes, uint64_t stream, uint64_t replaced, uint64_t full, uint64_t refused,
                          uint64_t decoded, uint64_t in_place) {
  f_->delta_decoded->Add({{"node", node}, {"how", "in_place"}}).Increment(static_cast<double>(in_place));
  f_->delta_decoded->Add({{"node", node}, {"how", "copied"}}).Increment(static_cast<double>(decoded - std::min(decoded, in_place)));
  f_->delta_cache->Add({{"node", node}}).Set(static_cast<double>(cache_bytes));
  f_->delta_bytes->Add({{"node", node}, {"kind", "stream"}}).Increment(static_cast<double>(stream));
  f_->delta_bytes->Add({{"node", node}, {"kind", "replaced"}}).Increment(static_cast<double>(replaced));
  f_->delta_bytes->Add({{"node", node}, {"kind", "full"}}).Increment(static_cast<double>(full));
  f_->delta_fallbacks->Add({{"node", node}}).Increment(static_cast<double>(refused));
}

void DaemonMetrics::Digests(const std::string& node, uint64_t transport, uint64_t codec, uint64_t memory) {
  f_->digest_bytes->Add({{"node", node}, {"how", "transport"}}).Increment(static_cast<double>(transport));
  f_->digest_bytes->Add({{"node", node}, {"how", "codec"}}).Increment(static_cast<double>(codec));
  f_->digest_bytes->Add({{"node", node}, {"how", "memory"}}).Increment(static_cast<double>(memory));
}

void DaemonMetrics::GuardEvents(const std::string& node, const std::string& transport, const std::string& what, uint64_t n) {
  f_->guard_events->Add({{"node", node}, {"transport", transport}, {"what", what}}).Increment(static_cast<double>(n));
}

void DaemonMetrics::GuardHeld(const std::string& node, const std::string& transport, const std::string& what, int64_t held) {
  f_->guard_held->Add({{"node", node}, {"transport", transport}, {"what", what}}).Set(static_cast<double>(held));
}

void DaemonMetrics::Failure(const std::string& node, const absl::Status& status) {
  f_->failures->Add({{"node", node}, {"reason", FailureReason(status)}}).Increment();
}

void DaemonMetrics::Rejected(const std::string& node, const std::string& what) {
  f_->rejected->Add({{"node", node}, {"what", what}}).Increment();
}

void DaemonMetrics::Committed(const std::string& node, const std::string& model, uint64_t version) {
  f_->committed->Add({{"node", node}, {"model", model}}).Set(static_cast<double>(version));
}

void DaemonMetrics::Applied(const std::string& node, const std::string& model, const std::string& worker,
                            uint64_t applied, uint64_t committed) {
  f_->applied->Add({{"node", node}, {"model", model}, {"worker", worker}}).Set(static_cast<double>(applied));
  f_->staleness->Add({{"node", node}, {"model", model}, {"worker", worker}})
      .Set(committed > applied ? static_cast<double>(committed - applied) : 0.0);
}

DaemonMetrics& Metrics() {
  static DaemonMetrics* m = new DaemonMetrics();
  return *m;
}

std::string FailureReason(const absl::Status& status) {
  const std::string msg = absl::AsciiStrToLower(status.message());
  auto has = [&](absl::string_view s) { return absl::StrContains(msg, s); };
  if (status.ok()) return "none";
  if (has("checksum")) return "checksum";
  if (has("restart")) return "restarted";
  if (has("lease") || has("lost")) return "node_lost";
  if (has("supersede")) return "superseded";
  if (has("deregister") || has("left") || has("registered again") || has("is gone")) return "worker_left";
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded: return "timeout";
    case absl::StatusCode::kUnauthenticated: return "unauthenticated";
    case absl::StatusCode::kPermissionDenied: return "permission";
    case absl::StatusCode::kResourceExhausted: return "limit";
    case absl::StatusCode::kInvalidArgument: return "invalid";
    case absl::StatusCode::kUnavailable: return "send";
    case absl::StatusCode::kAborted: return "aborted";
    default: break;
  }
  if (has("timeout") || has("in time")) return "timeout";
  if (has("-> node") || has("send") || has("connect")) return "send";
  return "other";
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen,
                                                                        std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  // prometheus-cpp (civetweb) reports a failed bind by throwing; this is the one boundary where
  // a third-party exception is turned into a status.
  try {
    // civetweb serves one connection per thread: with one thread, a single silent connection held
    // every scrape for its 30 s default timeout (and a client trickling bytes, for good). Several
    // threads and a short read timeout keep the endpoint answering while a few connections
    // stall; a flood of them still can (bind --metrics_listen to a trusted network).
    e->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", "8", "request_timeout_ms", "3000", "enable_keep_alive", "no"});
  } catch (const std::exception& ex) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", ex.what()));
  }
  e->exposer_->RegisterCollectable(registry);
  std::vector<int> ports = e->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) return absl::UnavailableError(absl::StrCat("metrics endpoint ", listen, " has no port"));
  e->port_ = ports[0];
  return e;
}

MetricsEndpoint::~MetricsEndpoint() = default;

}  // namespace wb::daemon

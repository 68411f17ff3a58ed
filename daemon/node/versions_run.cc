// node::Versions, part two: one version on its executor thread (see versions.h): the pure exec
// plan (daemon/node/exec_plan.h) run by the executor (daemon/node/executor.h) over this node's
// transports, channel setup with peers, and the report to the coordinator.
#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/digest/certify.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/exec_plan_proto.h"
#include "daemon/node/quantize_outgoing.h"
#include "daemon/node/versions.h"
#include "proto/convert.h"

namespace wb::daemon::node {

void Versions::RunExec(std::shared_ptr<Exec> exec) {
  const absl::Time t0 = options_.clock->Now();
  absl::Status s = RunExecInner(*exec);
  {
    // Before ReportDone: from here CommitVersion may make this staging the committed copy.
    absl::MutexLock l(&mu_);
    exec->transferred = s.ok();
    if (!s.ok()) {
      exec->failed = true;
      if (exec->error.empty()) exec->error = std::string(s.message());
    }
  }
  if (s.ok()) {
    // GB/s per link of this transfer (bytes over the summed batch times towards that peer).
    for (auto& [peer, ls] : exec->links) {
      if (ls.bytes > 0 && ls.seconds > 0) metrics().Link(options_.node_id, peer, ls.bytes, ls.seconds);
    }
  }
  // A catch-up whose sources here no longer hold the version (pb::CertifyBox) reports before its
  // channels go: the peers' executions would otherwise fail on the closed channels and their
  // reports (without the stale sources) could reach the coordinator first and end the catch-up for
  // good instead of trying it again from the other holders.
  const bool report_first = !s.ok() && !exec->stale_sources.empty();
  auto report = [&] {
    {
      absl::MutexLock l(&mu_);
      if (exec->aborted || stopping_) return;  // the coordinator already knows
    }
    ReportDone(*exec, s, t0);
  };
  if (report_first) report();
  if (!s.ok()) deltas_.Drop(exec->model_id, exec->version);  // its pending delta copies never become anyone's base
  // A failed batch may leave a channel unusable: the next version starts on fresh ones. But another
  // execution of the model (the next version, a catch-up) may be running on the same cached
  // channel: disconnecting it under that one failed it too ("unknown peer N", docs/soak.md). So a
  // channel is disconnected only once nothing uses it - also, after a success, one replaced in the
  // cache while this version ran on it.
  ReleaseChannels(*exec, !s.ok());
  if (!report_first) report();
}

void Versions::ReportDone(const Exec& exec, const absl::Status& s, absl::Time t0) {
  const double seconds = absl::ToDoubleSeconds(options_.clock->Now() - t0);
  Log(s.ok() ? LogLevel::kInfo : LogLevel::kWarning, s.ok() ? "version transferred" : "version failed",
      {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"bytes", exec.bytes_done.load()},
       {"seconds", seconds}, {"staging_s", exec.staging_s}, {"setup_s", exec.setup_s},
       {"buckets_s", exec.buckets_s}, {"relay_bytes_at_commit", exec.relay_bytes_at_commit}, {"digest_s", exec.digest_s},
       {"digest_bytes", exec.digests.bytes}, {"digest_transport_bytes", exec.digests.transport_bytes}, {"digest_codec_bytes", exec.digests.codec_bytes},
       {"digest_source_hash_s", exec.digests.source_hash_s}, {"digest_landed_hash_s", exec.digests.landed_hash_s}, {"delta_ops", exec.delta.ops_sent_delta}, {"delta_bytes", exec.delta.bytes_sent_stream},
       {"delta_replaced_bytes", exec.delta.bytes_sent_raw}, {"delta_full_bytes", exec.delta.bytes_sent_full},
       {"delta_decoded", exec.delta.ops_decoded}, {"delta_decoded_in_place", exec.delta.ops_decoded_in_place}, {"delta_fallbacks", exec.delta.ops_refused},
       {"delta_fallback_bytes", exec.delta.bytes_fallback}, {"delta_encode_s", exec.delta.encode_s}, {"delta_decode_s", exec.delta.decode_s},
       {"delta_cache_bytes", deltas_.bytes()}, {"delta_refusal", exec.delta.first_refusal}, {"error", s.message()}});
  metrics().Deltas(options_.node_id, deltas_.bytes(), exec.delta.bytes_sent_stream, exec.delta.bytes_sent_raw, exec.delta.bytes_sent_full,
                   exec.delta.ops_refused, exec.delta.ops_decoded, exec.delta.ops_decoded_in_place);
  if (s.ok()) {
    const int64_t hashed = exec.digests.transport_bytes + exec.digests.codec_bytes;
    metrics().Digests(options_.node_id, static_cast<uint64_t>(exec.digests.transport_bytes), static_cast<uint64_t>(exec.digests.codec_bytes),
                      static_cast<uint64_t>(std::max<int64_t>(0, exec.digests.bytes - hashed)));
  }
  pb::ReportDoneRequest req;
  req.set_node_id(options_.node_id);
  req.set_model_id(exec.model_id);
  req.set_version(exec.version);
  req.set_ok(s.ok());
  req.set_error(std::string(s.message()));
  req.set_bytes(exec.bytes_done.load());
  req.set_seconds(seconds);
  req.set_coordinator_instance(exec.coordinator_instance);
  for (const auto& [op, d] : exec.digests.source) {
    pb::OpDigest* o = req.add_source_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  for (const auto& [op, d] : exec.digests.landed) {
    pb::OpDigest* o = req.add_landed_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  req.set_catch_up(exec.catch_up);
  for (const std::string& w : exec.stale_sources) req.add_stale_sources(w);
  if (s.ok()) {
    for (const node::QuantizedPieceDigest& q : exec.quantized_pieces) {
      pb::QuantizedPieceDigest* p = req.add_quantized_pieces();
      p->set_worker_id(q.worker);
      p->set_tensor(q.tensor);
      convert::ToProto(q.box, p->mutable_box());
      p->set_digest(q.digest);
    }
  }
  req.set_plan_epoch(exec.epoch);  // tells attempts of one catch-up version apart
  req.set_delta_stream_bytes(static_cast<uint64_t>(exec.delta.bytes_sent_stream));
  req.set_delta_replaced_bytes(static_cast<uint64_t>(exec.delta.bytes_sent_raw));
  req.set_delta_fallback_bytes(static_cast<uint64_t>(exec.delta.bytes_fallback));
  pb::ReportDoneResponse resp;
  // Best effort: a lost report ends in the coordinator's version timeout (and abort).
  coordinator_.client().ReportDone(req, &resp, CallTimeout(options_.clock, options_.clock->Now() + absl::Seconds(10))).IgnoreError();
}

void Versions::Disconnect(const std::string& chan, transport::PeerId id) {
  transport::Transport* cross = transports_.OfChannel(chan);
  if (cross != nullptr && id != transport::kNoPeer) (void)cross->Disconnect(id);
}

void Versions::DropChannel(const std::string& model_id, const std::string& chan, transport::PeerId id) {
  channels_.Drop(model_id, chan, id);
  Disconnect(chan, id);
}

void Versions::ReleaseChannels(const Exec& exec, bool failed) {
  // A stale channel the ExchangeRegions handler forgot for a channel this execution never set up
  // (it failed first): SetupPeer would have disconnected it.
  std::vector<std::pair<std::string, transport::PeerId>> stale;
  {
    absl::MutexLock l(&mu_);
    for (const auto& [chan, ps] : exec.peers) {
      if (ps.lookup.stale != transport::kNoPeer) stale.push_back({chan, ps.lookup.stale});
    }
  }
  for (const auto& [chan, id] : stale) Disconnect(chan, id);
  for (const ChannelCache::Keyed& c : channels_.ReleaseAll(&exec, failed)) Disconnect(c.channel, c.id);
}

void Versions::AbortChannels(const Exec& exec, const std::map<std::string, int>& in_flight) {
  // Its batches in flight end CANCELLED (their mirrors on the peer too) where the transport can
  // cancel one execution's batches: the channel then stays for the executions sharing it. Where it
  // cannot (nccl, a wrapper), only a disconnect ends the waits: such a channel is `busy`.
  std::set<std::string> busy;
  std::map<transport::Transport*, bool> cancelled;  // per transport, once: CancelBatches is per group
  const std::string why = absl::StrCat(exec.model_id, " v", exec.version, " aborted on this node");
  for (const auto& [chan, n] : in_flight) {
    if (n <= 0) continue;
    transport::Transport* t = transports_.OfChannel(chan);
    if (t != nullptr && !cancelled.count(t)) cancelled[t] = t->CancelBatches(exec.batch_group, why).ok();
    if (t == nullptr || !cancelled[t]) busy.insert(chan);
  }
  const std::vector<ChannelCache::Keyed> drop = channels_.Abandon(&exec, busy);
  for (const ChannelCache::Keyed& c : drop) Disconnect(c.channel, c.id);
  if (!drop.empty() || !in_flight.empty()) {
    Log(LogLevel::kDebug, "aborted version's channels",
        {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"disconnected", drop.size()},
         {"busy", busy.size()}, {"batches_cancelled", in_flight.size() - busy.size()}});
  }
}

absl::StatusOr<ChannelLink> Versions::SetupPeer(Exec& exec, const ChannelPlan& channel, transport::Transport* cross) {
  const std::string& peer = channel.peer;
  const std::string& mine_name = channel.mine;
  const std::string& theirs_name = channel.theirs;
  const std::string& chan = channel.name;
  const std::string kind = mine_name == theirs_name ? mine_name : absl::StrCat(mine_name, " -> ", theirs_name);  // for messages
  const pb::PlanWorker* peer_worker = nullptr;
  for (const pb::PlanWorker& w : exec.plan->slice.workers()) {
    if (w.node_id() == peer) peer_worker = &w;
  }
  if (peer_worker == nullptr) return absl::InvalidArgumentError(absl::StrCat("node ", peer, " has no worker in the plan slice of model ", exec.model_id));
  auto inst_it = peer_worker->transport_instances().find(theirs_name);
  if (inst_it == peer_worker->transport_instances().end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", peer, " has no '", theirs_name, "' transport"));
  }
  const std::string& peer_instance = inst_it->second;
  // A peer that restarted (new transport instance) left a stale channel: disconnected (once no
  // execution holds it), not reused. A channel to reuse is held by this execution from here on.
  // The caller looks its cached channel up here; the receiver's ExchangeRegions handler does, and
  // decides against what it found (PeerState::lookup): one look-up per node and execution.
  const bool caller = options_.node_id < peer;
  ChannelCache::Lookup cache;
  if (caller) {
    cache = channels_.ForPeer(exec.model_id, chan, peer_instance, &exec);
    if (cache.stale != transport::kNoPeer) Disconnect(chan, cache.stale);
  }
  ASSIGN_OR_RETURN(std::string my_endpoint, cross->ExportEndpoint(peer_instance));
  bool reuse = false;
  bool rounds = false;  // both nodes Connect in this attempt's round (else in the empty round)
  std::string peer_endpoint;
  absl::Status ended;  // the receiver's: aborted while it waited for the caller
  if (caller) {
    // We call: the peer's regions and endpoint come back in the response.
    pb::ExchangeRegionsRequest req;
    req.set_model_id(exec.model_id);
    req.set_version(exec.version);
    req.set_plan_epoch(exec.epoch);
    req.set_from_node(options_.node_id);
    req.set_transport_kind(theirs_name);
    if (theirs_name != mine_name) req.set_from_transport(mine_name);
    req.set_endpoint(my_endpoint);
    req.set_reuse(cache.reuse != transport::kNoPeer);
    req.set_reuse_round(cache.round);
    req.set_connect_rounds(options_.connect_rounds);
    {
      absl::MutexLock l(&mu_);
      for (auto& [k, d] : exec.local_desc[mine_name]) {
        pb::PeerRegion* r = req.add_regions();
        r->set_key(k);
        r->set_region_descriptor(d);
      }
    }
    pb::ExchangeRegionsResponse resp;
    if (!options_.exchange_regions) return absl::InternalError(absl::StrCat("node ", options_.node_id, ": no way to reach peer nodes"));
    RETURN_IF_ERROR_WITH(options_.exchange_regions(peer, peer_worker->data_address(), req, &resp, exec.deadline),
                         absl::StrCat("exchanging regions with node ", peer));
    absl::MutexLock l(&mu_);
    PeerState& ps = exec.peers[chan];
    ps.have = true;
    ps.reuse = resp.reuse();
    // A peer built before rounds answers without the field: the empty round on both sides.
    ps.rounds = resp.connect_rounds() && options_.connect_rounds;
    ps.endpoint = resp.endpoint();
    for (const pb::PeerRegion& r : resp.regions()) ps.regions[r.key()] = r.region_descriptor();
    reuse = ps.reuse;
    rounds = ps.rounds;
    peer_endpoint = ps.endpoint;
  } else {
    // The peer calls us (ExchangeRegions handler fills exec.peers[peer]).
    absl::MutexLock l(&mu_);
    auto have = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto it = exec.peers.find(chan);
      return exec.aborted || stopping_ || (it != exec.peers.end() && it->second.have);
    };
    if (!options_.clock->WaitUntil(&mu_, absl::Condition(&have), exec.deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("node ", peer, " did not set up the data plane of version ", exec.version, " in time"));
    }
    PeerState& ps = exec.peers[chan];
    cache = ps.lookup;  // held for this execution by the handler
    ps.lookup.stale = transport::kNoPeer;  // disconnected below, once
    if (exec.aborted || stopping_) ended = absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    reuse = ps.reuse;
    rounds = ps.rounds;
    peer_endpoint = ps.endpoint;
  }
  if (cache.stale != transport::kNoPeer && !caller) Disconnect(chan, cache.stale);
  RETURN_IF_ERROR(ended);
  const transport::PeerId cached = cache.reuse;
  if (reuse && cached == transport::kNoPeer) {
    // The peer reuses a channel this node no longer caches (it was forgotten or replaced since):
    // fail rather than post on no connection; the next version connects afresh.
    return absl::FailedPreconditionError(absl::StrCat("node ", peer, " reuses a channel (", kind, ") node ", options_.node_id,
                                                      " no longer caches for model ", exec.model_id));
  }
  transport::PeerId id = cached;
  std::string round;  // of a new connection (ChannelCache::Entry::round)
  if (!reuse) {
    // The peer does not reuse it (its side was forgotten): out of the cache here too; disconnected
    // once no sibling execution runs on it.
    if (cached != transport::kNoPeer && channels_.Release(&exec, exec.model_id, chan, cached, /*forget=*/true)) Disconnect(chan, cached);
    // The round tells this attempt apart on both nodes: a Connect of an aborted version still
    // waiting here or on the peer never takes the connections of this one (ConnectRound). With a
    // peer built before rounds both use the empty round (as before them: such a Connect can).
    round = rounds ? ConnectRound(exec.model_id, exec.version, exec.epoch, options_.node_id, channel) : "";
    {
      // Checked and noted under mu_: an abort either came first (no Connect) or sees the round
      // and cancels it (CancelConnects), which also fails a Connect that starts after it.
      absl::MutexLock l(&mu_);
      if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
      if (!round.empty()) exec.connecting[chan] = {cross, round};
    }
    auto c = cross->Connect(peer_endpoint, round, exec.deadline);
    {
      absl::MutexLock l(&mu_);
      exec.connecting.erase(chan);
    }
    if (!c.ok()) return Annotate(c.status(), absl::StrCat("connecting to node ", peer, " (", kind, ")"));
    id = *c;
    Log(LogLevel::kDebug, "data channel connected", {{"model", exec.model_id}, {"version", exec.version}, {"peer", peer}, {"transport", kind}});
  }
  ChannelLink link;
  link.id = id;
  transport::PeerId replaced = transport::kNoPeer;
  absl::Status aborted;
  {
    absl::MutexLock l(&mu_);
    // Another version of the model may have cached its own channel meanwhile; the one we replace
    // must be disconnected (its fds closed): now when no execution holds it, else by its last
    // holder's release (ChannelCache::Put). A reused channel is held since ForPeer and is not
    // cached again: a sibling that failed on it meanwhile took it out of the cache for good.
    if (!reuse) replaced = channels_.Put(exec.model_id, chan, id, peer_instance, &exec, round);
    exec.connected[chan] = id;
    link.regions = exec.peers[chan].regions;
    if (exec.aborted) aborted = absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
  }
  if (replaced != transport::kNoPeer) Disconnect(chan, replaced);
  if (!aborted.ok()) return aborted;
  return link;
}

// The executor's way to its peers (ChannelSetup): our descriptors go into exec.local_desc (the
// ExchangeRegions handler answers with them), and each channel is set up by SetupPeer
// (ExchangeRegions + the model's channel cache).
class Versions::ExecChannels final : public ChannelSetup {
 public:
  ExecChannels(Versions* v, Exec& exec) : v_(v), exec_(exec) {}
  void Publish(std::map<std::string, std::map<std::string, std::string>> descriptors) override {
    absl::MutexLock l(&v_->mu_);
    exec_.local_desc = std::move(descriptors);
    exec_.regions_ready = true;
  }
  absl::StatusOr<ChannelLink> Setup(const ChannelPlan& channel, transport::Transport* t, absl::Time) override {
    return v_->SetupPeer(exec_, channel, t);
  }

 private:
  Versions* v_;
  Exec& exec_;
};

node::ExecOptions Versions::ExecOptionsFor(Exec& exec) {
  const std::string& me = options_.node_id;
  node::ExecOptions o;
  o.label = absl::StrCat(exec.model_id, " v", exec.version);
  o.version = exec.version;
  o.deadline = exec.deadline;
  o.aborted = [this, &exec]() -> absl::Status {
    absl::MutexLock l(&mu_);
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    return absl::OkStatus();
  };
  // Batches in flight per channel (AbortChannels). Checked and counted under mu_, where an abort
  // sets `aborted` and reads the counts: either the abort sees this batch (and disconnects its
  // channel) or the batch sees the abort (and is not posted).
  o.channel_post = [this, &exec](const std::string& chan) -> absl::Status {
    absl::MutexLock l(&mu_);
    if (exec.aborted || stopping_) return absl::AbortedError(absl::StrCat("version ", exec.version, " aborted: ", exec.error));
    ++exec.in_flight[chan];
    return absl::OkStatus();
  };
  o.batch_group = exec.batch_group;
  o.channel_waited = [this, &exec](const std::string& chan) {
    absl::MutexLock l(&mu_);
    auto it = exec.in_flight.find(chan);
    if (it != exec.in_flight.end() && --it->second <= 0) exec.in_flight.erase(it);
  };
  if (options_.test_before_bucket) o.before_bucket = [this, &exec](uint32_t b) { options_.test_before_bucket(exec.model_id, exec.version, b); };
  o.device_staging = [this](int device, int64_t size, const std::string& what) { return staging_.TryDeviceStaging(device, size, what); };
  DaemonMetrics* m = &metrics();
  o.on_batch_done = [m, me, model = exec.model_id](const node::Route& r, const std::string& kind) {
    m->Bytes(me, model, kind, r.peer, static_cast<uint64_t>(r.bytes));
    if (r.lane.first >= 0) m->NcclLane(me, r.peer, r.lane.first, r.lane.second, static_cast<uint64_t>(r.bytes));
  };
  o.on_bounce = [m, me](uint64_t bytes) { m->NcclBounce(me, bytes); };
  // Per-NIC bytes of the host channel (also of a failed batch: those bytes did cross the wire).
  transport::Transport* cross_t = transports_.CrossHost();
  std::map<std::string, std::string> peer_instances;  // the peers' host-channel transport instance -> node
  if (cross_t != nullptr) {
    const std::string kind = cross_t->capabilities().kind;
    for (const pb::PlanWorker& w : exec.plan->slice.workers()) {
      auto it = w.transport_instances().find(kind);
      if (w.node_id() != me && it != w.transport_instances().end()) peer_instances[it->second] = w.node_id();
    }
  }
  if (cross_t != nullptr && !peer_instances.empty()) {
    o.after_wait = [this, m, me, cross_t, peer_instances] { nic_meter_.Record(*m, me, cross_t->stats().paths, peer_instances); };
  }
  o.bytes_done = &exec.bytes_done;
  // Lossless deltas (not for catch-ups: their slices carry no delta ops).
  if (!exec.catch_up) {
    o.deltas = deltas_.For(me, exec.model_id, exec.plan->slice, exec.base_versions, local_, exec.staging_holds, exec.incoming,
                           exec.bases_without_shadows, exec.bases_held);
  }
  return o;
}

// One version on this node: staging, the memory of each region key, the pure exec plan
// (daemon/node/exec_plan.h: channel order, relays at commit, routes) and its run over the
// transports (daemon/node/executor.h).
absl::Status Versions::RunExecInner(Exec& exec) {
  const ModelPlan& plan = *exec.plan;
  const std::string& me = options_.node_id;
  using transport::MemoryKind;
  absl::Time phase_start = options_.clock->Now();  // phase times for the "version transferred" log line
  node::ExecTransports transports;
  transports.local = transports_.Local();
  transports.cross = transports_.CrossHost();
  transports.cuda = transports_.Cuda();
  transports.lanes = transports_.NcclLanes();
  node::ExecFacts facts;
  facts.me = me;
  for (auto& [device, t] : transports.lanes) facts.lanes.insert(device);
  const node::Slice slice = node::SliceFromProto(plan.slice, plan.layouts, plan.quantized, plan.hosts_gather, plan.inventory,
                                                 plan.live_layouts);
  ASSIGN_OR_RETURN(node::LanePlan lanes, node::PlanLanes(slice, me, facts.lanes));

  // 0. Staging of this version, allocated here (outside mu_).
  RETURN_IF_ERROR(AllocateStaging(exec, lanes));
  exec.staging_s = absl::ToDoubleSeconds(options_.clock->Now() - phase_start);
  phase_start = options_.clock->Now();

  // 1. The memory behind each region key of this version on this node.
  VersionMemory memory;
  RETURN_IF_ERROR(GatherVersionMemory(exec, memory));

  // 2. The plan: which transport reaches which region, channels, relays at commit, routes.
  for (auto& [key, m] : memory.regions) facts.kind[key] = m.kind;
  if (plan.slice.mode() == pb::MODE_SYNC) facts.host_live_sync = HostLiveSyncRollouts(plan);
  facts.cross_kind = transports.cross != nullptr ? transports.cross->capabilities().kind : "host_tcp";
  facts.have_local = transports.local != nullptr;
  facts.have_cuda = transports.cuda != nullptr;
  facts.have_cross = transports.cross != nullptr;
  facts.checksums = options_.checksums;
  ASSIGN_OR_RETURN(node::ExecPlan made, node::MakeExecPlan(slice, facts));
  auto xplan = std::make_shared<const node::ExecPlan>(std::move(made));
  {
    absl::MutexLock l(&mu_);
    exec.exec_plan = xplan;
    exec.relays_at_commit = xplan->relays_at_commit;
    exec.pieces_at_commit = xplan->pieces_at_commit;
    exec.relay_bytes_at_commit = xplan->relay_bytes_at_commit;
  }
  // Sender-side quantisation (issue 17.1): this node's trainers' boxes of sender-quantised ops are
  // quantised into its q staging (pooled, charged to the node's budget) in the background, in
  // bucket order; the executor waits for a bucket's ops before posting it (before_post below;
  // daemon/node/quantize_outgoing.h). Declared after `memory`: its threads stop before the sources go.
  std::unique_ptr<node::OutgoingQuantization> qout;
  if (!xplan->quant_out.empty()) {
    node::OutgoingOptions qo;
    qo.budget = &staging_.budget();
    qo.allocate = [this](int64_t size, const std::string&) -> absl::StatusOr<node::QStaging> {
      std::shared_ptr<Bytes> bytes = staging_.NewBytes(1);
      (*bytes)[0].host = staging_.TakeHost(size);  // recycled: see daemon/staging_pool.h
      return node::QStaging{(*bytes)[0].host.data(), bytes};
    };
    ASSIGN_OR_RETURN(qout, node::OutgoingQuantization::Start(plan.inventory, xplan->quant_out, node::QuantBuckets(*xplan), memory.regions,
                                                             absl::StrCat(exec.model_id, " v", exec.version), exec.deadline, qo));
    for (const auto& [key, m] : qout->regions()) memory.regions[key] = m;
    memory.holds.push_back(qout->hold());
  }

  // Receiver-side quantising: each quantised piece as soon as every op into it landed, beside the
  // buckets (daemon/node/quantize_incoming.h). Declared after `memory`; its threads stop before
  // RunExecInner returns (exec.incoming, the staging it writes, lives longer).
  ASSIGN_OR_RETURN(std::unique_ptr<node::IncomingQuantization> qin, StartQuantizing(exec, slice));

  // 3. Register, set up channels, run the buckets. End-to-end digests hash alongside (docs/daemon.md
  // "End-to-end digests"): sources at once, each landed box as its batch completes. Declared after
  // `memory`: a failed version's tracker stops hashing before the memory goes.
  const double prepare_s = absl::ToDoubleSeconds(options_.clock->Now() - phase_start);
  node::ExecOptions exec_options = ExecOptionsFor(exec);
  if (qout != nullptr) {
    exec_options.before_post = [prev = std::move(exec_options.before_post), q = qout.get()](uint32_t bucket) -> absl::Status {
      if (prev) RETURN_IF_ERROR(prev(bucket));
      return q->WaitBucket(bucket);
    };
    // Deltas of sender-quantised ops encode the quantised bytes: each waits for its bucket's.
    exec_options.deltas.source_ready = [q = qout.get()](uint32_t bucket) { return q->WaitReady(bucket); };
  }
  std::unique_ptr<digest::OpDigestTracker> digests;
  if (options_.digests) {
    ASSIGN_OR_RETURN(digests, StartDigests(exec, slice, *xplan, memory, exec_options));
  }
  if (qin != nullptr) exec_options.on_op_landed = [q = qin.get()](const node::RouteOp& op) { q->OpLanded(op.op_index); };
  // A catch-up's sources here still hold the committed version: their boxes hashed where the
  // catch-up reads them, against the digests the version landed with (pb::CertifyBox;
  // daemon/digest/certify.h), beside the buckets (both only read them). Declared after `memory`.
  digest::SourceCertification certification;
  if (options_.digests && !slice.certify.empty()) {
    certification.Start(slice, me, HostRegions(memory), options_.digest_threads, exec.deadline);
  }
  ExecChannels channels(this, exec);
  node::ExecResult result;
  absl::Status s = node::RunExecPlan(*xplan, memory.regions, transports, channels, exec_options, result);
  exec.links = result.links;
  exec.delta = result.delta;
  exec.setup_s = prepare_s + result.setup_s;
  exec.buckets_s = result.buckets_s;
  RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(FinishCertification(exec, certification));
  if (qout != nullptr) RETURN_IF_ERROR(FinishOutgoingQuantization(exec, *qout));
  // Sync: trainers' live segments were read in place (a trainer may truncate its memory
  // mid-version; ShmSegment's SIGBUS guard kept the daemon alive meanwhile).
  for (auto& [what, seg] : memory.live_sources) {
    if (absl::Status intact = seg->CheckIntact(); !intact.ok()) {
      return absl::Status(intact.code(), absl::StrCat("version ", exec.version, ": ", what, ": ", intact.message()));
    }
  }
  exec.bytes_done += exec.relay_bytes_at_commit;  // in staging as far as the commit is concerned
  phase_start = options_.clock->Now();
  RETURN_IF_ERROR(DigestVersion(exec, memory, digests.get()));
  if (options_.digests) {
    // Sender-quantised ops (issue 17.1): both sides digest the quantised bytes that travel.
    RETURN_IF_ERROR(node::DigestSenderQuantized(slice, me, HostRegions(memory), options_.digest_threads, exec.deadline, exec.digests));
  }
  // After the digests: they hash the shadows (canonical bytes) the quantiser reads; it writes only
  // the pieces' places and scales.
  if (qin != nullptr) RETURN_IF_ERROR(FinishQuantizing(exec, *qin));
  exec.buckets_s += absl::ToDoubleSeconds(options_.clock->Now() - phase_start);
  return absl::OkStatus();
}

// The host address of each region of `memory` (device memory, with none, has no digest).
std::map<std::string, digest::RegionBytes> Versions::HostRegions(const VersionMemory& memory) {
  std::map<std::string, digest::RegionBytes> host;
  for (const auto& [key, m] : memory.regions) host[key] = {m.kind == transport::MemoryKind::kHost ? m.base : nullptr, m.size};
  return host;
}

// End-to-end digests hash alongside the buckets (docs/daemon.md "End-to-end digests"): sources at
// once, each landed box as its batch completes; wires the tracker into `exec_options`.
absl::StatusOr<std::unique_ptr<digest::OpDigestTracker>> Versions::StartDigests(Exec& exec, const node::Slice& slice,
                                                                               const node::ExecPlan& xplan, const VersionMemory& memory,
                                                                               node::ExecOptions& exec_options) {
  // Delta ops' boxes: hashed by the codec as it packs the source / decodes into staging
  // (DeltaOptions::unit_hashes), like host_tcp's for what it moves in full.
  std::set<std::pair<uint32_t, bool>> codec_sides;
  if (options_.digest_in_transport) codec_sides = node::DeltaHashedSides(xplan, exec_options.deltas);
  absl::StatusOr<std::unique_ptr<digest::OpDigestTracker>> t = digest::OpDigestTracker::Start(
      slice, options_.node_id, xplan, HostRegions(memory),
      {.threads = options_.digest_threads, .deadline = exec.deadline, .overlap = options_.digest_overlap,
       .in_transport = options_.digest_in_transport, .codec_sides = std::move(codec_sides)});
  if (!t.ok()) return Annotate(t.status(), absl::StrCat("version ", exec.version, ": end-to-end digests"));
  std::unique_ptr<digest::OpDigestTracker> digests = std::move(*t);
  // host_tcp hashes what it moves as it moves it (digest::OpDigestTracker::PrepareBatch).
  if (options_.digest_in_transport) {
    exec_options.prepare_batch = [d = digests.get()](const node::Route& r, transport::Batch& b) { d->PrepareBatch(r, b); };
    exec_options.deltas.unit_hashes = [d = digests.get()](const node::RouteOp& op, bool landed, const std::vector<uint64_t>* h) {
      d->CodecHashes(op.op_index, landed, h);
    };
  }
  exec_options.on_batch_done = [metered = std::move(exec_options.on_batch_done), d = digests.get()](const node::Route& r, const std::string& kind) {
    if (metered) metered(r, kind);
    d->OnRouteDone(r);
  };
  return digests;
}

// A catch-up's sources certified (or not) against version v's landed digests: a stale one fails
// the catch-up, naming the first mismatch, and is reported (exec.stale_sources).
absl::Status Versions::FinishCertification(Exec& exec, digest::SourceCertification& certification) {
  if (!certification.started()) return absl::OkStatus();
  absl::StatusOr<digest::CertifyOutcome> certified = certification.Finish();
  if (!certified.ok()) {
    return Annotate(certified.status(), absl::StrCat("catch-up of model ", exec.model_id, " to version ", exec.version));
  }
  if (!certified->stale.empty()) {
    exec.stale_sources = certified->stale;
    return absl::DataLossError(
        absl::StrCat("catch-up of model ", exec.model_id, " to version ", exec.version, ": ", certified->first_mismatch, ": not served"));
  }
  Log(LogLevel::kInfo, "catch-up sources certified",
      {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"boxes", certified->boxes},
       {"bytes", certified->bytes}, {"device_boxes_not_hashed", certified->skipped}});
  return absl::OkStatus();
}

// Sender-side quantisation's end: every op written (ops no bucket reads, none expected, too).
absl::Status Versions::FinishOutgoingQuantization(const Exec& exec, node::OutgoingQuantization& qout) {
  RETURN_IF_ERROR(qout.WaitAll());
  const node::OutgoingQuantization::Stats q = qout.stats();
  Log(LogLevel::kInfo, "version quantised on send",
      {{"node", options_.node_id}, {"model", exec.model_id}, {"version", exec.version}, {"ops", q.ops}, {"chunks", q.chunks},
       {"bytes", q.canonical_bytes}, {"gathered_bytes", q.gathered_bytes}, {"wire_bytes", q.wire_bytes}, {"threads", q.threads},
       {"seconds", q.seconds}, {"waited_seconds", q.waited_seconds}});
  return absl::OkStatus();
}

}  // namespace wb::daemon::node

#include "daemon/node/delta_node.h"

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wb::daemon::node {

int ResolveDeltaThreads(int requested, unsigned cpus) {
  if (requested > 0) return requested;
  return static_cast<int>(std::clamp<unsigned>(cpus / 2, 2, 16));
}

namespace {

// "w<worker>.b<buffer>" -> (worker, buffer).
std::optional<std::pair<uint32_t, size_t>> ParseKey(const std::string& key) {
  unsigned w = 0, b = 0;
  char tail = 0;
  if (std::sscanf(key.c_str(), "w%u.b%u%c", &w, &b, &tail) != 2) return std::nullopt;
  return std::pair<uint32_t, size_t>{w, b};
}

}  // namespace

NodeDeltas::Model::~Model() {
  {
    absl::MutexLock l(&delay_mu);
    stopping = true;
  }
  if (cache != nullptr) cache->StopWarming();
  {
    absl::MutexLock l(&warm_mu);
    if (warmer.joinable()) warmer.join();
  }
  if (clock != nullptr) clock->Forget(&delay_mu);
}

std::shared_ptr<NodeDeltas::Model> NodeDeltas::ModelFor(const std::string& model) {
  absl::MutexLock l(&mu_);
  std::shared_ptr<Model>& m = models_[model];
  if (m == nullptr) {
    m = std::make_shared<Model>();
    m->clock = clock_;
    m->cache = std::make_unique<DeltaCache>(cache_bytes_);
  }
  return m;
}

DeltaOptions NodeDeltas::For(const std::string& me, const std::string& model, const pb::PlanSlice& slice,
                             const std::map<std::string, uint64_t>& base_versions, const LocalWorkers& local,
                             const std::map<std::pair<std::string, size_t>, uint64_t>& staging_holds,
                             const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming,
                             const std::set<std::string>& bases_without_shadows,
                             const std::map<std::string, std::pair<uint64_t, std::shared_ptr<StagedBytes>>>& bases_held) {
  std::shared_ptr<Model> m = ModelFor(model);
  DeltaOptions o;
  o.me = me;
  o.threads = threads_;
  o.cache = m->cache->enabled() ? m->cache.get() : nullptr;
  o.buffers = &m->buffers;
  std::map<uint32_t, std::string> local_rollouts;  // slice index -> worker id
  for (int i = 0; i < slice.workers_size(); ++i) {
    const pb::PlanWorker& w = slice.workers(i);
    auto bv = base_versions.find(w.worker_id());
    if (bv != base_versions.end() && bv->second > 0) o.base_versions[static_cast<uint32_t>(i)] = bv->second;
    if (bases_without_shadows.count(w.worker_id()) > 0) o.without_shadows.insert(static_cast<uint32_t>(i));
    if (w.node_id() == me && w.role() == pb::ROLE_ROLLOUT) local_rollouts[static_cast<uint32_t>(i)] = w.worker_id();
  }
  // Recorded base digests, by destination box. Slice indices change with plans: the key names the
  // rollout by worker id.
  auto box_key = [local_rollouts](const RouteOp& op) -> std::optional<std::string> {
    std::optional<std::pair<uint32_t, size_t>> at = ParseKey(op.dst_key);
    if (!at) return std::nullopt;
    auto id = local_rollouts.find(at->first);
    if (id == local_rollouts.end()) return std::nullopt;
    return absl::StrCat(id->second, "|", at->second, "|", op.copy.dst.offset_bytes, "|",
                        DeltaKey::Of(op.tensor, op.box, op.copy.element_size, op.delta_variant).ToString(), "|", op.delta_variant);
  };
  o.recorded = [m, box_key](const RouteOp& op, uint64_t version) -> std::optional<delta::Digest> {
    std::optional<std::string> k = box_key(op);
    if (!k) return std::nullopt;
    absl::MutexLock l(&m->digests_mu);
    auto it = m->digests.find(*k);
    if (it == m->digests.end() || it->second.first != version) return std::nullopt;
    return it->second.second;
  };
  o.record = [m, box_key](const RouteOp& op, uint64_t version, const delta::Digest& digest) {
    std::optional<std::string> k = box_key(op);
    if (!k) return;
    absl::MutexLock l(&m->digests_mu);
    m->digests[*k] = {version, digest};
  };
  // `m` travels with the options: the cache and buffers outlive the executor run.
  // Incoming staging that still holds the committed version (taken back from the pool by tag):
  // the base is the destination itself, and DecodeOp decodes in place (no copy of the base).
  std::map<std::pair<std::string, size_t>, DeltaBase> in_place;
  for (const auto& [at, version] : staging_holds) {
    auto in = incoming.find(at.first);
    if (in == incoming.end() || in->second == nullptr || at.second >= in->second->size()) continue;
    const StagedBuffer& b = (*in->second)[at.second];
    if (b.device != nullptr || b.host.empty()) continue;
    in_place[at] = DeltaBase{version, b.host.data(), b.size(), in->second, "the incoming staging (in place)"};
  }
  // Each local rollout's committed staging when the version starts, kept for its decodes: a
  // one-step-off / async rollout may Apply it while the version runs, which lets it go from the
  // worker's entry (the live weights then hold the same version, but without the canonical shadows
  // of receiver-quantised pieces: deltas into those would be refused and resent in full). Held
  // only while these options live; nothing writes committed staging.
  // Staging the version's staging choice held on to comes first unless the worker now holds a
  // newer committed staging (the rollout's Apply may have let go of it in between, and an applied
  // staging still held by its Apply is in no worker entry at all).
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<StagedBytes>>> committed_at_start;
  for (const auto& [wid, held] : bases_held) {
    if (held.second != nullptr) committed_at_start[wid] = held;
  }
  // What each rollout held when the version started, named in a refusal against its live weights
  // (which lack the shadows: such a refusal means no staging with the base was found).
  std::map<std::string, std::string> state_at_start;
  for (const auto& [index, wid] : local_rollouts) {
    std::optional<LocalWorkers::View> v = local.Get({model, wid});
    if (v && v->worker.committed != nullptr) {
      auto& c = committed_at_start[wid];
      if (c.second == nullptr || v->worker.committed_version >= c.first) c = {v->worker.committed_version, v->worker.committed};
    }
    if (v) {
      bool held_in_place = false;
      for (const auto& [at, version] : in_place) held_in_place = held_in_place || at.first == wid;
      state_at_start[wid] = absl::StrCat("at the start committed v", v->worker.committed_version, " applied v", v->worker.applied_version,
                                         v->worker.committed != nullptr ? ", committed staging held" : ", no committed staging",
                                         held_in_place ? ", in place" : ", not in place");
    }
  }
  o.base = [m, model, local_rollouts, &local, in_place, committed_at_start, state_at_start](const std::string& key) -> std::optional<DeltaBase> {
    std::optional<std::pair<uint32_t, size_t>> at = ParseKey(key);
    if (!at) return std::nullopt;
    auto id = local_rollouts.find(at->first);
    if (id == local_rollouts.end()) return std::nullopt;
    if (auto ip = in_place.find({id->second, at->second}); ip != in_place.end()) return ip->second;
    std::optional<LocalWorkers::View> v = local.Get({model, id->second});
    if (!v) return std::nullopt;
    const LocalWorkers::Worker& w = v->worker;
    const size_t j = at->second;
    std::shared_ptr<StagedBytes> committed = w.committed;
    uint64_t committed_version = w.committed_version;
    std::string what = "the committed staging";
    if (auto c = committed_at_start.find(id->second); committed == nullptr && c != committed_at_start.end() &&
                                                      c->second.first >= w.applied_version) {
      committed_version = c->second.first;
      committed = c->second.second;
      what = "the committed staging held at the start";
    }
    if (committed != nullptr && j < committed->size() && (*committed)[j].device == nullptr) {
      const StagedBuffer& b = (*committed)[j];
      return DeltaBase{committed_version, b.host.data(), b.size(), committed, what};
    }
    // Sync commits hand committed staging back to the pool once live weights hold it.
    if (w.applied_version > 0 && !v->copying && v->torn.ok() && j < w.buffers.size() && w.buffers[j] != nullptr) {
      const std::shared_ptr<transport::ShmSegment>& seg = w.buffers[j];
      auto st = state_at_start.find(id->second);
      return DeltaBase{w.applied_version, static_cast<const uint8_t*>(seg->data()), static_cast<int64_t>(seg->size()), seg,
                       absl::StrCat("the live weights; committed v", w.committed_version, " applied v", w.applied_version, " now; ",
                                    st != state_at_start.end() ? st->second : std::string("not local at the start"))};
    }
    return std::nullopt;
  };
  return o;
}

void NodeDeltas::Commit(const std::string& model, uint64_t version) {
  std::shared_ptr<Model> m;
  {
    absl::MutexLock l(&mu_);
    auto it = models_.find(model);
    if (it == models_.end()) return;
    m = it->second;
  }
  m->cache->Commit(version);
  // In the background: apply the streams this commit queued to the cached copies in place (the
  // cache at 1x: DeltaCache::AddPendingStream; an encode that comes first applies its key itself),
  // then warm the next version's pack buffers of boxes that still pack full copies. At normal
  // priority: at nice 10 the bench's trainers starved it until the next version came.
  // It starts apply_delay_ after the commit: this node's CommitVersion answers before the other
  // nodes of the version finish theirs (a rollout node copies staging into live weights then), and
  // an apply right away competes with those copies for the memory bandwidth of a host that runs
  // several node daemons (bench:e2e: about 8% of a delta version's update time). An RL step is
  // longer than the delay; a next version that comes sooner applies each key it encodes itself
  // (DeltaCache::Committed).
  if (!m->cache->enabled() || m->warming.exchange(true)) return;
  absl::MutexLock l(&m->warm_mu);
  if (m->warmer.joinable()) m->warmer.join();  // finished: `warming` was false
  // `model` outlives the thread: ~Model joins it.
  m->warmer = std::thread([model = m.get(), delay = apply_delay_] {
    pthread_setname_np(pthread_self(), "wb-delta-warm");
    bool stopping = false;
    if (delay > absl::ZeroDuration()) {
      absl::MutexLock l(&model->delay_mu);
      stopping = model->clock->WaitUntil(&model->delay_mu, absl::Condition(&model->stopping), model->clock->Now() + delay);
    }
    if (!stopping) {
      model->cache->ApplyQueued();
      model->cache->WarmSpares();
      model->cache->ApplyQueued();  // committed while it warmed
    }
    model->warming.store(false);
  });
}

void NodeDeltas::Drop(const std::string& model, uint64_t version) {
  std::shared_ptr<Model> m;
  {
    absl::MutexLock l(&mu_);
    auto it = models_.find(model);
    if (it == models_.end()) return;
    m = it->second;
  }
  m->cache->Drop(version);
}

uint64_t NodeDeltas::bytes() const {
  absl::MutexLock l(&mu_);
  uint64_t total = 0;
  for (const auto& [name, m] : models_) total += m->cache->bytes();
  return total;
}

}  // namespace wb::daemon::node

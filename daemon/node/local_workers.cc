#include "daemon/node/local_workers.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"
#include "daemon/auth.h"
#include "daemon/log.h"
#include "planner/box.h"

namespace wb::daemon {

PidWatch::~PidWatch() {
  if (fd >= 0) ::close(fd);
}

bool PidWatch::Alive() const {
  if (fd >= 0) {
    // A pidfd becomes readable when the process exits (pid reuse cannot fool it).
    struct pollfd p = {fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  return ::kill(pid, 0) == 0 || errno != ESRCH;
}

bool PidWatch::IsLive(int other) const {
  return other == pid && start_time != 0 && Alive() && ProcessStartTime(other) == start_time;
}

std::string PidWatch::Identity() const { return start_time == 0 ? std::string() : absl::StrCat(pid, "@", start_time); }

absl::StatusOr<std::shared_ptr<PidWatch>> PidWatch::Open(int pid, const std::string& who) {
  auto watch = std::make_shared<PidWatch>();
  watch->pid = pid;
  watch->start_time = ProcessStartTime(pid);
#ifdef SYS_pidfd_open
  watch->fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#endif
  if (watch->fd < 0 && errno == ESRCH) return absl::InvalidArgumentError(absl::StrCat(who, ": pid ", pid, " does not exist"));
  return watch;
}

namespace {

// The file shm name `name` names now (as IdentifySegments: /dev/shm); nullopt when none.
std::optional<SegmentId> IdentifyName(const std::string& name) {
  const std::string path = absl::StrCat("/dev/shm", name.empty() || name[0] != '/' ? "/" : "", name);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return SegmentId{name, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

// Whether `req`'s buffers are the very memory `w` mapped: the same shm files (by name and
// identity, mappings intact) and, unless `cuda_by_request` (the caller compared the whole request
// already), the same CUDA IPC handles; a CUDA VMM key is then never the same memory (which
// allocation a key stands for is the worker's to say).
bool SameMemory(const LocalWorkers::Worker& w, const pb::RegisterLayoutRequest& req, bool cuda_by_request,
                const std::vector<std::vector<std::string>>* vmm_now = nullptr) {
  if (static_cast<size_t>(req.buffers_size()) != w.buffers.size() || w.cuda.size() != w.buffers.size()) return false;
  size_t host = 0;
  for (int i = 0; i < req.buffers_size(); ++i) {
    const pb::BufferSpec& b = req.buffers(i);
    const auto& seg = w.buffers[i];
    if (b.memory_case() == pb::BufferSpec::kShmName) {
      if (seg == nullptr || seg->name() != b.shm_name() || !seg->CheckIntact().ok()) return false;
      std::optional<SegmentId> now = IdentifyName(b.shm_name());
      if (!now || host >= w.segments.size() || !(*now == w.segments[host])) return false;
      ++host;
      continue;
    }
    if (w.cuda[i] == nullptr) return false;
    if (cuda_by_request) {
      // The request names the same keys; the allocations behind them must be the imported ones.
      if (b.memory_case() == pb::BufferSpec::kCudaVmmKey &&
          (vmm_now == nullptr || static_cast<size_t>(i) >= vmm_now->size() || (*vmm_now)[i] != w.cuda[i]->allocation_keys)) {
        return false;
      }
      continue;
    }
    const pb::BufferSpec* was = static_cast<size_t>(i) < w.layout_buffers.size() ? &w.layout_buffers[i] : nullptr;
    if (b.memory_case() != pb::BufferSpec::kCudaIpcHandle || was == nullptr || was->memory_case() != pb::BufferSpec::kCudaIpcHandle ||
        was->cuda_ipc_handle() != b.cuda_ipc_handle()) {
      return false;
    }
  }
  return true;
}

}  // namespace

LocalWorkers::LocalWorkers(Options options) : options_(std::move(options)) {}

LocalWorkers::~LocalWorkers() { options_.clock->Forget(&mu_); }

void LocalWorkers::AttachMarkers(LiveMarkers* markers) {
  absl::MutexLock l(&mu_);
  live_.AttachMarkers(markers);
}

void LocalWorkers::Stop() {
  absl::MutexLock l(&mu_);
  stopping_ = true;
}

absl::Status LocalWorkers::BeginJoin(const WorkerKey& key, absl::Time deadline, const pb::RegisterWorkerRequest* req) {
  if (req != nullptr && req->client_instance().size() > kMaxClientInstanceBytes) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterWorker.client_instance of worker ", key.second, " is ", req->client_instance().size(),
                                                   " bytes; at most ", kMaxClientInstanceBytes));
  }
  // An earlier process of this worker id that exited: its LeaveWorker must reach the coordinator
  // before this join, or it would drop the new registration there (found by the soak test
  // under TSan: a restarted rollout's RegisterLayout got NOT_FOUND).
  absl::MutexLock l(&mu_);
  auto not_leaving = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return leaving_.count(key) == 0 || stopping_; };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&not_leaving), deadline)) {
    return absl::UnavailableError(absl::StrCat("worker ", key.second, " of model ", key.first, ": its previous process is still leaving (retry)"));
  }
  if (req != nullptr) {
    if (absl::Status other = CheckSameProcessClientLocked(key, *req); !other.ok()) return other;
  }
  // Not reaped yet by the liveness check: this join replaces it (the coordinator treats it as
  // registered again), so no LeaveWorker is sent for it.
  // Another model's worker under the same id is another worker (ids are scoped per model):
  // only this model's entry is replaced.
  auto old = workers_.find(key);
  if (old != workers_.end() && old->second.pid && !old->second.pid->Alive()) workers_.erase(old);
  joining_.insert(key);
  if (req != nullptr) joining_registration_[key] = *req;
  return absl::OkStatus();
}

void LocalWorkers::EndJoin(const WorkerKey& key) {
  absl::MutexLock l(&mu_);
  joining_.erase(key);
  joining_registration_.erase(key);
}

absl::Status LocalWorkers::CheckSameProcessClientLocked(const WorkerKey& key, const pb::RegisterWorkerRequest& req) {
  // Two clients of one process under one worker id: the node's worker guard lets both through (the
  // same process), and before the client token the second one's identical request was answered as
  // a replay of the first's (or, differing, replaced it). Only the tokens tell them apart; either
  // one empty (a client built before them): as before.
  if (req.client_instance().empty() || req.pid() <= 0) return absl::OkStatus();
  const pb::RegisterWorkerRequest* holder = nullptr;
  std::string process;
  if (auto it = workers_.find(key); it != workers_.end() && it->second.pid != nullptr && it->second.pid->IsLive(req.pid())) {
    holder = &it->second.registration;
    process = it->second.pid->Identity();
  } else if (auto j = joining_registration_.find(key); j != joining_registration_.end() && j->second.pid() == req.pid()) {
    holder = &j->second;  // registering right now (its process is the caller's: the same pid, alive)
    process = absl::StrCat(req.pid());
  }
  if (holder == nullptr || holder->client_instance().empty() || holder->client_instance() == req.client_instance()) return absl::OkStatus();
  return absl::AlreadyExistsError(absl::StrCat(
      "worker ", key.second, " of model ", key.first, " on node ", options_.node_id, " is registered by another client of the same process (pid ",
      req.pid(), ", process ", process, "): one client per worker id in a process - deregister it through the client that registered it (or end "
      "that client's process), or register this client under another worker id"));
}

void LocalWorkers::Add(const WorkerKey& key, Worker w, std::optional<planner::Inventory> inventory) {
  absl::MutexLock l(&mu_);
  if (inventory) inventories_[key.first] = std::move(*inventory);
  w.incarnation = next_incarnation_++;
  workers_[key] = std::move(w);
  owed_leaves_.erase(key);  // the join replaced the old registration at the coordinator
  live_.Forget(LiveKey(key.first, key.second));  // a new process: its memory, not the old one's
}

absl::StatusOr<uint64_t> LocalWorkers::AttachLayout(const WorkerKey& key, std::vector<std::shared_ptr<transport::ShmSegment>> buffers,
                                                    std::vector<std::shared_ptr<CudaImport>> cuda, pb::SubmitLayoutRequest submitted,
                                                    const pb::ResolvedLayout& resolved) {
  // The layout's bytes (what its pieces cover), not the registered buffers' sizes (which
  // include padding, probe buffers, ...). Worked out, and the layout serialized, before mu_ is
  // taken: 1e6 pieces take a second, and every worker call of this node waits for mu_.
  uint64_t bytes = 0;
  if (std::optional<planner::Inventory> inv = Inventory(key.first)) {
    auto layout = convert::LayoutFromProto(resolved, *inv);
    if (layout.ok()) {
      for (const planner::Piece& p : layout->pieces) {
        bytes += static_cast<uint64_t>(planner::BoxVolume(p.box) * planner::DTypeSize(inv->tensors[p.tensor].dtype));
      }
    }
  }
  std::string submitted_bytes = submitted.SerializeAsString();
  submitted.Clear();
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end()) return absl::NotFoundError("worker deregistered concurrently");
  Worker& w = it->second;
  absl::StatusOr<std::vector<SegmentId>> ids = IdentifySegments(buffers);
  std::vector<SegmentId> segments = ids.ok() ? *std::move(ids) : std::vector<SegmentId>();
  bool same = ids.ok() && segments == w.segments && cuda.size() == w.cuda.size();
  for (size_t j = 0; same && j < cuda.size(); ++j) same = (cuda[j] == nullptr) == (w.cuda[j] == nullptr);
  if (w.has_layout && w.applied_version > 0 && !same) {
    // Other memory under the same entry (a rollout's new memory re-joins before this - NewMemory -
    // so this is a trainer, or memory that changed between the two): its live weights hold no
    // version. The committed copy, if any, is still whole: Apply / BeginUpdate copy it in.
    Log(LogLevel::kWarning, "layout attached over new memory: live weights hold no version",
        {{"node", options_.node_id}, {"model", key.first}, {"worker", key.second}, {"was_applied", w.applied_version}});
    w.applied_version = 0;
    live_.Forget(LiveKey(key.first, key.second));
  }
  w.segments = std::move(segments);
  it->second.buffers = std::move(buffers);
  it->second.cuda = std::move(cuda);
  it->second.has_layout = true;  // pieces live in the plan slice the coordinator installs
  it->second.layout_request.clear();  // recorded once answered (RecordLayoutAnswer)
  it->second.layout_response.clear();
  it->second.layout_buffers.clear();
  // Memory an earlier process of this daemon died copying into (a live-copy marker): TORN.
  live_.Adopt(key.first, LiveKey(key.first, key.second), it->second.buffers, options_.node_id);
  it->second.submitted = std::move(submitted_bytes);
  return bytes;
}

bool LocalWorkers::RepeatRegistration(const WorkerKey& key, const pb::RegisterWorkerRequest& req) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || joining_.count(key) > 0 || leaving_.count(key) > 0) return false;
  Worker& w = it->second;
  // (No map fields in these messages: equal requests serialize to equal bytes.)
  if (w.pid == nullptr || !w.pid->IsLive(req.pid()) || w.registration.SerializeAsString() != req.SerializeAsString()) return false;
  w.repeat_pending = w.has_layout;
  return true;
}

std::optional<pb::RegisterLayoutResponse> LocalWorkers::SameLayout(const WorkerKey& key, const pb::RegisterLayoutRequest& req,
                                                                   const std::vector<std::vector<std::string>>& vmm_now) {
  if (req.layout().has_index_probe()) return std::nullopt;
  const std::string req_bytes = req.SerializeAsString();  // (no map fields: equal requests, equal bytes)
  std::string answer;
  {
    absl::MutexLock l(&mu_);
    auto it = workers_.find(key);
    if (it == workers_.end() || !it->second.has_layout || it->second.layout_buffers.empty()) return std::nullopt;
    if (it->second.layout_request != req_bytes) return std::nullopt;
    // A mapping that faulted (the worker truncated its segment under a copy) or shrank stays refused
    // until the worker registers its layout again (docs/security.md): that registration maps anew,
    // even when its request is the same. So does a name that now names another file (the worker
    // unlinked its segment and created a new one under the same name): the node must map that one.
    if (!SameMemory(it->second, req, /*cuda_by_request=*/true, &vmm_now)) return std::nullopt;
    it->second.repeat_pending = false;
    answer = it->second.layout_response;
  }
  pb::RegisterLayoutResponse resp;
  if (!resp.ParseFromString(answer)) return std::nullopt;  // (never: this process serialized it)
  return resp;
}

std::optional<pb::RegisterWorkerRequest> LocalWorkers::TakeRepeat(const WorkerKey& key) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || !it->second.repeat_pending) return std::nullopt;
  it->second.repeat_pending = false;
  return it->second.registration;
}

std::optional<pb::RegisterWorkerRequest> LocalWorkers::NewMemory(const WorkerKey& key, const pb::RegisterLayoutRequest& req) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || !it->second.has_layout || it->second.role != planner::Role::kRollout) return std::nullopt;
  if (SameMemory(it->second, req, /*cuda_by_request=*/false)) return std::nullopt;
  return it->second.registration;
}

void LocalWorkers::RecordLayoutAnswer(const WorkerKey& key, const pb::RegisterLayoutRequest& req, const pb::RegisterLayoutResponse& resp) {
  if (req.buffers().empty()) return;  // (never the same layout again: SameLayout)
  std::string req_bytes = req.SerializeAsString(), resp_bytes = resp.SerializeAsString();
  std::vector<pb::BufferSpec> buffers(req.buffers().begin(), req.buffers().end());
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || !it->second.has_layout) return;
  it->second.layout_request = std::move(req_bytes);
  it->second.layout_response = std::move(resp_bytes);
  it->second.layout_buffers = std::move(buffers);
}

void LocalWorkers::Remove(const WorkerKey& key) {
  absl::MutexLock l(&mu_);
  workers_.erase(key);
  live_.Forget(LiveKey(key.first, key.second));
}

std::vector<LocalWorkers::WorkerKey> LocalWorkers::ReapExited() {
  std::vector<WorkerKey> gone;
  absl::MutexLock l(&mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second.pid && !it->second.pid->Alive() && joining_.count(it->first) == 0) {
      gone.push_back(it->first);
      leaving_.insert(it->first);
      Log(LogLevel::kWarning, "worker process exited", {{"node", options_.node_id}, {"model", it->first.first},
                                                        {"worker", it->first.second}, {"pid", it->second.pid->pid}});
      live_.Forget(LiveKey(it->first.first, it->first.second));
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  return gone;
}

void LocalWorkers::LeaveDone(const WorkerKey& key) {
  absl::MutexLock l(&mu_);
  leaving_.erase(key);
}

bool LocalWorkers::Has(const WorkerKey& key) const {
  absl::MutexLock l(&mu_);
  return workers_.count(key) > 0;
}

uint64_t LocalWorkers::Incarnation(const WorkerKey& key) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  return it == workers_.end() ? 0 : it->second.incarnation;
}

std::optional<LocalWorkers::View> LocalWorkers::Get(const WorkerKey& key) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end()) return std::nullopt;
  View v;
  const Worker& w = it->second;
  v.worker.model_id = w.model_id;
  v.worker.role = w.role;
  v.worker.gpu = w.gpu;
  v.worker.mode = w.mode;
  v.worker.has_layout = w.has_layout;
  v.worker.buffers = w.buffers;
  v.worker.cuda = w.cuda;
  v.worker.snapshots = w.snapshots;
  v.worker.committed = w.committed;
  v.worker.committed_version = w.committed_version;
  v.worker.applied_version = w.applied_version;
  v.worker.pid = w.pid;
  v.worker.spec = w.spec;
  v.worker.paused = w.paused;
  const std::string lk = LiveKey(key.first, key.second);
  v.copying = live_.Copying(lk);
  v.torn = live_.TornError(lk, options_.node_id);
  return v;
}

std::vector<std::shared_ptr<CudaImport>> LocalWorkers::Cuda(const WorkerKey& key) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  return it == workers_.end() ? std::vector<std::shared_ptr<CudaImport>>() : it->second.cuda;
}

std::optional<planner::Inventory> LocalWorkers::Inventory(const std::string& model) const {
  absl::MutexLock l(&mu_);
  auto it = inventories_.find(model);
  if (it == inventories_.end()) return std::nullopt;
  return it->second;
}

std::optional<pb::ModelSpec> LocalWorkers::SpecOf(const std::string& model, const std::string& worker,
                                                  std::optional<planner::Role>* role) const {
  absl::MutexLock l(&mu_);
  std::optional<pb::ModelSpec> spec;
  auto w = workers_.find({model, worker});
  if (w != workers_.end() && w->second.model_id == model) {
    spec = w->second.spec;
    if (!*role) *role = w->second.role;
  }
  for (auto it = workers_.begin(); !spec && it != workers_.end(); ++it) {
    if (it->second.model_id == model) spec = it->second.spec;
  }
  return spec;
}

absl::Status LocalWorkers::TornRollout(const std::string& model) const {
  absl::MutexLock l(&mu_);
  for (const auto& [key, w] : workers_) {
    if (w.model_id != model || w.role != planner::Role::kRollout) continue;
    if (absl::Status torn = live_.TornError(LiveKey(key.first, key.second), options_.node_id); !torn.ok()) return torn;
  }
  return absl::OkStatus();
}

void LocalWorkers::AddLiveState(pb::StatusResponse* resp) const {
  absl::MutexLock l(&mu_);
  for (pb::WorkerStatus& ws : *resp->mutable_workers()) {
    if (ws.node_id() != options_.node_id || workers_.count({ws.model_id(), ws.worker_id()}) == 0) continue;
    const std::string lk = LiveKey(ws.model_id(), ws.worker_id());
    const LiveState::Info info = live_.Get(lk);
    ws.set_live_state(LiveState::Name(info.state));
    if (info.state == LiveState::State::kWhole) continue;
    ws.set_live_writing_version(info.writing);
    ws.set_live_over_version(info.over);
    if (info.state == LiveState::State::kTorn) ws.set_live_detail(std::string(live_.TornError(lk, options_.node_id).message()));
  }
}

void LocalWorkers::NoteAborted(const std::string& model, uint64_t version, const std::string& reason) {
  absl::MutexLock l(&mu_);
  aborted_[{model, version}] = reason;
}

void LocalWorkers::ForgetAborted(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  aborted_.erase({model, version});
}

std::optional<std::string> LocalWorkers::AbortReason(const std::string& model, uint64_t version) const {
  absl::MutexLock l(&mu_);
  auto it = aborted_.find({model, version});
  if (it == aborted_.end()) return std::nullopt;
  return it->second;
}

void LocalWorkers::NoteCatchUpAborted(const std::string& model, uint64_t version, const std::string& reason) {
  absl::MutexLock l(&mu_);
  catch_up_aborted_[{model, version}] = reason;
}

std::optional<std::string> LocalWorkers::CatchUpAbortReason(const std::string& model, uint64_t version) const {
  absl::MutexLock l(&mu_);
  auto it = catch_up_aborted_.find({model, version});
  if (it == catch_up_aborted_.end()) return std::nullopt;
  return it->second;
}

bool LocalWorkers::AddSnapshot(const WorkerKey& key, uint64_t version, std::shared_ptr<Bytes> snapshot) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end()) return false;
  it->second.snapshots[version] = std::move(snapshot);
  return true;
}

void LocalWorkers::DropSnapshot(const WorkerKey& key, uint64_t version) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it != workers_.end()) it->second.snapshots.erase(version);
}

void LocalWorkers::DropSnapshots(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto& [key, w] : workers_) {
    if (w.model_id == model) w.snapshots.erase(version);
  }
}

void LocalWorkers::DropSnapshotsBefore(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto& [key, w] : workers_) {
    if (w.model_id != model) continue;
    for (auto it = w.snapshots.begin(); it != w.snapshots.end();) {
      it = it->first < version ? w.snapshots.erase(it) : std::next(it);
    }
  }
}

std::vector<LocalWorkers::LiveJob> LocalWorkers::Commit(const std::string& model, uint64_t version,
                                                        const std::map<std::string, std::shared_ptr<Bytes>>& incoming,
                                                        const std::set<std::string>& relayed, bool catch_up) {
  std::vector<LiveJob> jobs;
  absl::MutexLock l(&mu_);
  for (const auto& [wid, staging] : incoming) {
    auto w = workers_.find({model, wid});
    if (w == workers_.end()) continue;
    // Relays at commit: this staging lacks the relayed pieces, so it must never be applied
    // later (Apply finds no committed staging; the commit writes the live weights).
    const bool relays = relayed.count(wid) > 0;
    w->second.committed = relays ? nullptr : staging;
    w->second.committed_version = version;
    if (catch_up) w->second.caught_up_version = version;
    if (w->second.mode != pb::MODE_SYNC) continue;
    // Resumed (EndUpdate): its engine reads its live weights now. The staging stays its
    // committed copy, which its next BeginUpdate (or Apply, WaitVersion) copies - as in
    // one-step-off. A staging that lacks pieces relayed at commit gets its job all the same:
    // when the copy would start, RunLiveCopies copies the relays into that staging (resumed) or
    // writes the live weights (paused again by then).
    if (!w->second.paused && !relays) continue;
    // Captured by value (buffers): a concurrent Deregister may erase the worker meanwhile.
    LiveJob t;
    t.model = model;
    t.worker = wid;
    t.version = version;
    t.staging = staging;
    t.live = LiveBuffers{w->second.buffers, w->second.cuda};
    t.needs_pause = !relays;
    jobs.push_back(std::move(t));
  }
  return jobs;
}

std::vector<std::string> LocalWorkers::DropAbortedCommit(const std::string& model, uint64_t version) {
  std::vector<std::string> dropped;
  absl::MutexLock l(&mu_);
  for (auto& [key, w] : workers_) {
    if (key.first != model || w.role != planner::Role::kRollout || w.committed_version != version || w.applied_version >= version) continue;
    w.committed = nullptr;
    w.committed_version = w.applied_version;
    dropped.push_back(key.second);
  }
  return dropped;
}

void LocalWorkers::MarkApplied(const WorkerKey& key, uint64_t version, const std::shared_ptr<Bytes>& staging, bool after_commit) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end()) return;
  Worker& w = it->second;
  // RunLiveCopies recorded what the live weights hold; a job it skipped (the worker resumed) did
  // not make them hold `version`: its staging stays the committed copy.
  if (w.applied_version < version) return;
  // Live weights hold it now and nothing reads this staging again (Apply finds nothing newer):
  // its memory goes back to the pool for the next version instead of sitting here.
  if (w.committed == staging && (after_commit || w.applied_version >= w.committed_version)) w.committed = nullptr;
}

absl::StatusOr<LocalWorkers::Applicable> LocalWorkers::AwaitApplicable(const WorkerKey& key, uint64_t want, absl::Time deadline,
                                                                       bool ask_on_catch_up_abort, bool ask_if_unknown_since_rejoin) const {
  const std::string& me = options_.node_id;
  const std::string& model = key.first;
  const std::string& wid = key.second;
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || it->second.role != planner::Role::kRollout) {
    return absl::NotFoundError(absl::StrCat("worker ", wid, " of model ", model, " is not a rollout worker on node ", me));
  }
  const std::string lk = LiveKey(model, wid);  // LiveState's name for it
  const uint64_t restarts0 = restarts_;
  // Since the re-join nothing ran here at or below `want`: it may be a number the old coordinator
  // used (its execution never reached this node: no abort recorded) that no coordinator runs again.
  // Every number the new session runs is above the used ones: one it ran here at or below `want` settles it.
  auto first = session_first_.find(model);
  if (ask_if_unknown_since_rejoin && want != 0 && restarts_ > 0 && it->second.committed_version < want && it->second.applied_version < want &&
      aborted_.count({model, want}) == 0 && (first == session_first_.end() || want < first->second)) {
    Applicable ask;
    ask.ask_coordinator = ask.unknown_since_rejoin = true;
    return ask;
  }
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto w = workers_.find(key);
    if (stopping_ || w == workers_.end()) return true;
    if (live_.Copying(lk)) return false;  // its outcome decides what we answer
    if (want == 0) return true;           // safe point: take whatever is newest, never wait
    return w->second.committed_version >= want || w->second.applied_version >= want || aborted_.count({model, want}) > 0 ||
           restarts_ != restarts0 || (ask_on_catch_up_abort && catch_up_aborted_.count({model, want}) > 0);
  };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&ready), deadline)) {
    if (live_.Copying(lk)) {
      return absl::DeadlineExceededError(
          absl::StrCat("worker ", lk, ": a copy into its live weights is still running on node ", me, " (call Apply again to learn its outcome)"));
    }
    return absl::DeadlineExceededError(absl::StrCat("version ", want, " not committed on node ", me, " in time"));
  }
  it = workers_.find(key);
  if (stopping_ || it == workers_.end()) return absl::UnavailableError("worker or daemon went away");
  const Worker& w = it->second;
  if (want != 0 && w.committed_version < want && w.applied_version < want) {
    auto ab = aborted_.find({model, want});
    if (ab == aborted_.end() && restarts_ == restarts0 && ask_on_catch_up_abort && catch_up_aborted_.count({model, want}) > 0) {
      // A catch-up attempt of `want` ended here: whether this rollout gets another one (or was
      // told why not) is the coordinator's to say, not this node's record - the record is the
      // node's, not the rollout's, and may be of an attempt that never included it.
      Applicable ask;
      ask.ask_coordinator = true;
      return ask;
    }
    return absl::AbortedError(absl::StrCat("version ", want, " aborted: ", ab != aborted_.end() ? ab->second : restart_reason_));
  }
  Applicable out;
  out.applied_version = w.applied_version;
  out.copy_Bps = live_copy_Bps_;
  if (w.committed_version <= w.applied_version || !w.committed) {
    // Nothing newer to copy (or sync: the commit wrote live weights). Torn weights with no
    // staging to restore them from stay torn until the next commit: say so.
    if (absl::Status torn = live_.TornError(lk, me); !torn.ok()) return torn;
    return out;
  }
  out.version = w.committed_version;
  out.staging = w.committed;
  out.live = LiveBuffers{w.buffers, w.cuda};
  return out;
}

absl::Status LocalWorkers::StartLiveCopyLocked(LiveJob& job) {
  auto w = workers_.find({job.model, job.worker});
  const std::string lk = LiveKey(job.model, job.worker);
  // A call of a process that was replaced while it waited: the entry (and its live memory) is
  // another process's now, whose engine may be reading it. Nothing is written, nothing recorded.
  if (job.incarnation != 0 && (w == workers_.end() || w->second.incarnation != job.incarnation)) {
    job.skipped = true;
    job.holds = w == workers_.end() ? 0 : w->second.applied_version;
    return absl::AbortedError(absl::StrCat("worker ", lk, " registered again on node ", options_.node_id,
                                           " (another process or new memory) while this call waited: the call is the earlier "
                                           "registration's, so nothing was copied into the live weights of the new one"));
  }
  // Live weights of the same memory (not a new process's) that hold this version or a newer one
  // whole: nothing to copy. Two Apply calls (or an Apply and BeginUpdate's copy) that raced:
  // the one that waited behind a newer version's copy must not write the older version over it.
  const bool same_memory = w != workers_.end() && w->second.buffers == job.live.host && w->second.cuda == job.live.cuda;
  if (same_memory && w->second.applied_version >= job.version && !live_.Torn(lk)) {
    job.skipped = true;
    job.holds = w->second.applied_version;
    return absl::OkStatus();
  }
  // A sync commit's copy into a rollout that resumed (EndUpdate): its staging stays its committed
  // copy (LocalWorkers::Commit set it), for its next BeginUpdate. With relays at commit, the
  // relayed pieces go into that staging first (RunLiveCopies), never into its live memory.
  if ((job.needs_pause || job.relays != nullptr) && w != workers_.end() && !w->second.paused && w->second.mode == pb::MODE_SYNC) {
    job.skipped = true;
    job.to_staging = job.relays != nullptr;
    job.holds = w->second.applied_version;
    return absl::OkStatus();
  }
  live_.Begin(lk, job.version, w == workers_.end() ? 0 : w->second.applied_version);
  // On disk before the first byte: a daemon killed mid-copy reports it after its restart.
  return live_.Mark(job.model, lk, job.live.host);
}

std::vector<absl::Status> LocalWorkers::RunLiveCopies(std::vector<LiveJob>& jobs) {
  std::vector<absl::Status> out(jobs.size());
  if (jobs.empty()) return out;
  const std::string& me = options_.node_id;
  Clock* clock = options_.clock;
  {
    // One copy per worker at a time: a second one (a retried commit, an Apply racing the commit)
    // waits for the first, bounded, so two versions never interleave in live memory.
    absl::MutexLock l(&mu_);
    auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stopping_ || std::none_of(jobs.begin(), jobs.end(), [&](const LiveJob& j) { return live_.Copying(LiveKey(j.model, j.worker)); });
    };
    if (!clock->WaitUntil(&mu_, absl::Condition(&idle), clock->Now() + options_.live_copy_timeout) || stopping_) {
      for (size_t i = 0; i < jobs.size(); ++i) {
        out[i] = absl::UnavailableError(absl::StrCat("worker ", jobs[i].worker, " of model ", jobs[i].model,
                                                     ": another copy into its live weights is still running on node ", me));
      }
      return out;
    }
    for (size_t i = 0; i < jobs.size(); ++i) out[i] = StartLiveCopyLocked(jobs[i]);
  }
  // Its own deadline: once bytes go into live memory the copy finishes (or fails) on its own
  // terms; cutting it at a client's deadline is what left weights half new, half old. The copy
  // runs on the transport, whose deadlines (and the copy speed measured below) are real time.
  const absl::Time deadline = absl::Now() + options_.live_copy_timeout;
  std::vector<char> wrote(jobs.size(), 0);
  auto copy_one = [&](size_t i) {
    LiveJob& j = jobs[i];
    if (out[i].ok() && j.to_staging) {
      // Resumed: the relayed pieces complete its staging (no live write, nothing recorded).
      out[i] = options_.copier->CopyRelaysToStaging(*j.relays, *j.incoming, *j.staging, absl::StrCat(j.label, " relays into staging"), deadline);
      return;
    }
    if (!out[i].ok() || j.skipped) return;  // not recorded: not started
    bool w = false;
    out[i] = options_.copier->CopyToLive(*j.staging, j.live, j.layout, *j.inventory, j.label, deadline, &w);
    wrote[i] = w;
    if (out[i].ok() && j.relays != nullptr) {
      out[i] = options_.copier->CopyRelaysToLive(*j.relays, *j.incoming, j.live.host, j.label, deadline, &w);
      wrote[i] = wrote[i] || w;
    }
  };
  const absl::Time copy_start = absl::Now();
  std::vector<std::thread> copiers;
  for (size_t i = 1; i < jobs.size(); ++i) copiers.emplace_back(copy_one, i);
  copy_one(0);
  for (std::thread& th : copiers) th.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - copy_start);
  int64_t bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    for (const StagedBuffer& b : *jobs[i].staging) bytes += out[i].ok() && !jobs[i].skipped ? b.size() : 0;
  }
  absl::MutexLock l(&mu_);
  if (bytes >= (int64_t{1} << 20) && seconds > 0) {
    // Copy speed for Apply's "does it fit" estimate: smoothed, never above 100 GB/s.
    live_copy_Bps_ = 0.5 * live_copy_Bps_ + 0.5 * std::min(1e11, static_cast<double>(bytes) / seconds);
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].to_staging && out[i].ok()) {
      // Its staging holds the whole version now: its committed copy (unless a newer one came).
      auto w = workers_.find({jobs[i].model, jobs[i].worker});
      if (w != workers_.end() && w->second.committed_version == jobs[i].version && w->second.committed == nullptr) {
        w->second.committed = jobs[i].staging;
      }
      Log(LogLevel::kInfo, "relays at commit into the staging of a resumed rollout",
          {{"node", me}, {"model", jobs[i].model}, {"worker", jobs[i].worker}, {"version", jobs[i].version}});
    }
    if (jobs[i].skipped) continue;
    const std::string lk = LiveKey(jobs[i].model, jobs[i].worker);
    live_.End(lk, out[i], wrote[i]);
    if (out[i].ok()) {
      // Recorded with the end of the copy, under one lock: a copy waiting behind this one sees
      // what live weights hold as soon as it may start (StartLiveCopyLocked).
      auto w = workers_.find({jobs[i].model, jobs[i].worker});
      if (w != workers_.end() && w->second.buffers == jobs[i].live.host && w->second.cuda == jobs[i].live.cuda) {
        w->second.applied_version = jobs[i].version;
      }
      jobs[i].holds = jobs[i].version;
      continue;
    }
    if (!wrote[i]) continue;
    Log(LogLevel::kError, "live weights torn",
        {{"node", me}, {"model", jobs[i].model}, {"worker", jobs[i].worker}, {"version", jobs[i].version}, {"error", out[i].message()}});
    absl::Status torn = live_.TornError(lk, me);
    // Forgotten meanwhile (the worker left): still say what happened to the copy.
    out[i] = torn.ok() ? absl::DataLossError(absl::StrCat("live weights of worker ", lk, " on node ", me, " are TORN: ", out[i].message()))
                       : torn;
  }
  return out;
}

bool LocalWorkers::Pause(const WorkerKey& key) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || it->second.role != planner::Role::kRollout) return false;
  it->second.paused = true;
  it->second.pause_mark = it->second.committed_version;  // before the coordinator hears of it
  return true;
}

void LocalWorkers::NotePausedAt(const WorkerKey& key, uint64_t committed) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it != workers_.end() && it->second.paused) it->second.paused_at_committed = std::max<uint64_t>(committed, 1);
}

bool LocalWorkers::PausedAfter(const WorkerKey& key, uint64_t version, uint64_t incarnation) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  return it != workers_.end() && (incarnation == 0 || it->second.incarnation == incarnation) && it->second.role == planner::Role::kRollout && it->second.mode == pb::MODE_SYNC &&
         it->second.paused && it->second.paused_at_committed > 0 && version <= it->second.paused_at_committed;
}

absl::StatusOr<LocalWorkers::Ended> LocalWorkers::EndUpdate(const WorkerKey& key, absl::Time deadline, uint64_t incarnation) {
  const std::string& me = options_.node_id;
  const std::string lk = LiveKey(key.first, key.second);
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || it->second.role != planner::Role::kRollout) {
    return absl::NotFoundError(absl::StrCat("EndUpdate: worker ", lk, " is not a rollout worker on node ", me));
  }
  if (incarnation != 0 && it->second.incarnation != incarnation) {
    return absl::AbortedError(absl::StrCat("worker ", lk, " was registered again on node ", me,
                                           " while this call ran (another process): its pause is left as it is"));
  }
  // From here on no copy into its live weights starts (Commit, StartLiveCopyLocked); one that is
  // running already finishes (a copy is never cut short: live_copy.h) and is waited for.
  it->second.paused = false;
  it->second.paused_at_committed = 0;
  auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || workers_.count(key) == 0 || !live_.Copying(lk); };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&idle), deadline)) {
    const LiveState::Info info = live_.Get(lk);
    return absl::DeadlineExceededError(absl::StrCat(
        "EndUpdate: worker ", lk, " on node ", me, ": a copy of version ", info.writing, " into its live weights (started before EndUpdate) is still running",
        " when the call's timeout ended; it runs to its end (live copy timeout) - call EndUpdate again and do not read the live weights until it answers OK"));
  }
  it = workers_.find(key);
  if (stopping_ || it == workers_.end()) {
    return absl::UnavailableError(absl::StrCat("EndUpdate: worker ", lk, " on node ", me, ": the worker or the daemon went away"));
  }
  if (absl::Status torn = live_.TornError(lk, me); !torn.ok()) return torn;
  Ended out;
  out.applied_version = it->second.applied_version;
  out.committed_version = it->second.committed_version;
  return out;
}

}  // namespace wb::daemon

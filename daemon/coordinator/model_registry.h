#pragma once
// The coordinator's model registry (docs/architecture.md "Coordinator"): the models (spec,
// inventory, version machine, plan state), their workers and the workers' layouts.
//
// NOT thread-safe: plain data that CoordinatorCore guards with its mu_ (every call is made with
// mu_ held; the member is ABSL_GUARDED_BY(mu_)). It never blocks or calls a node; it builds
// inventories and resolves layouts (bounded CPU work the handlers did under mu_ before, too).
//
// Contract:
//   - Create: a new model needs an inventory source (explicit_tensors, or hf_config_json with
//     optional LoRA) and worker counts > 0, and is refused (RESOURCE_EXHAUSTED naming the limit)
//     beyond max_models. The same spec again is OK (created = false); a different one is
//     ALREADY_EXISTS. A worker joining with a spec (ForJoin) is checked field by field: the error
//     names the worker and every differing field with both values (checks.h CheckSameSpec).
//   - Get: NOT_FOUND "unknown model <id>".
//   - CheckReplySize: a reply carrying the inventory must fit max_reply_bytes; a model the failing
//     call created is removed again, so a failed creation leaves nothing behind.
//   - Model addresses are stable while the model exists (std::map nodes): the driver and the
//     planner thread keep Model* across unlocked work. Models are removed by a failed creation,
//     inside the call that created them, before any other thread saw them, and by eviction
//     (below).
//   - Eviction (docs/daemon.md "Idle models are evicted"): a Create that would pass max_models
//     first removes the model idle longest among the evictable ones, else is RESOURCE_EXHAUSTED
//     saying why each model is kept (WhyKept). Evictable: no workers, never a version
//     (VersionMachine::newest_known() == 0: it never decreases), no hold, not planning /
//     committing / catching up, and untouched for idle_grace (options.clock).
//   - Why eviction never pulls a model from under a thread: every use of a Model* is under
//     CoordinatorCore's mu_, and so is eviction. A Model* kept across a release of mu_ (a waiting
//     call, the planner's RunPlan) is covered by a hold (Hold/Release, Held), and eviction skips
//     held models. The driver's start / commit / catch-up work also keeps Model* unlocked; it
//     exists only for models with a version, which are never evicted. A call that arrives after
//     the eviction looks the id up under mu_ again and finds nothing (NOT_FOUND) or, with a spec
//     (CreateModel, JoinWorker), creates the model afresh.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/coordinator/digest_book.h"
#include "daemon/coordinator/magnitude_book.h"
#include "daemon/coordinator/stored_pieces.h"
#include "daemon/version_machine.h"
#include "planner/model_config.h"
#include "planner/packed_layout.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

// Versions per model whose digest verdicts and delta tallies the coordinator keeps for
// ClusterStatus (as many as the version machine keeps records).
inline constexpr size_t kVersionDetailsKept = 64;

class ModelRegistry {
 public:
  struct WorkerRec {
    std::string node;
    planner::Role role = planner::Role::kTrainer;
    int32_t gpu = 0;
    bool has_layout = false;
    // Sync: BeginUpdate seen for the next version. Kept here too because the version machine only
    // knows rollouts of the current plan: a pause that arrives before the (re-)plan is re-applied.
    bool paused = false;
    // Sync rollout: the versions its pending WaitVersion calls (forwarded by its node with its
    // worker id) wait for, while they wait. A paused rollout waiting for a version newer than one
    // that commits or aborts stays paused (CoordinatorCore::PausedPastLocked).
    std::multiset<uint64_t> waits;
    // The layout as it was resolved, kept once (docs/security.md, the size probe's entry): the
    // planner's form, packed (planner/packed_layout.h: ~80 bytes per 2-D piece, unpacked only into
    // a plan's problem), which the planner, slicer, catch-up and NVFP4 books read; the buffers as
    // registered (layout_proto: no pieces); the pieces as resolved, encoded (layout_pieces: parsed
    // only into the slices and the plan cache key). All three shared with plan snapshots.
    std::shared_ptr<const ::weightbridge::v1::ResolvedLayout> layout_proto;
    std::shared_ptr<const StoredPieces> layout_pieces;
    std::shared_ptr<const planner::PackedLayout> layout;
    uint64_t restored_applied = 0;  // rollout re-joined after a coordinator restart: its applied version
    // Catch-up (catch_up.cc): the committed version this rollout's node holds for it (committed
    // staging or live weights), set when a version or a catch-up is committed on its node; a
    // rollout holding less than the model's committed version is late and is caught up.
    uint64_t holds = 0;
    // `holds` came from a catch-up (the other rollouts' quantised bytes, copied into its pieces'
    // places): its node holds no canonical shadows of it for receiver-quantised pieces, so the next
    // version's deltas into those would have no base (ExecuteVersionRequest.bases_without_shadows).
    // Cleared when a version reaches it through its plan (every shadow written). After a
    // coordinator restart its node says so when it re-joins (JoinWorkerRequest.holds_without_shadows).
    // Named to the nodes only when every node of the plan reads it (StartWorkLocked); else the
    // rollout gets no base at all.
    bool holds_without_shadows = false;
    uint64_t catch_up_failed = 0;  // the committed version its last catch-up failed for (not retried)
    std::string catch_up_error;
    // A catch-up found this source's memory no longer holding `stale_version` (PlanSlice.certify):
    // not a source of that version again; the next version rewrites it. Why, for the status.
    uint64_t stale_version = 0;
    std::string stale_error;
    uint64_t serial = 0;           // unique per registration (a catch-up notices a re-registered worker)
    // The worker's process as its node identified it (JoinWorkerRequest.process; empty: unknown).
    // Sync: a trainer's publish is read from this process's live memory.
    std::string process;
  };
  // A catch-up in progress (catch_up.cc): `version` (committed) again, from the rollouts that hold
  // it to the late ones, on its own plan epoch; normal versions wait until it ends.
  struct CatchUpRun {
    uint64_t version = 0;
    uint64_t epoch = 0;
    enum class Phase { kRunning, kDone, kCommitting } phase = Phase::kRunning;  // kDone: every node reported done
    std::map<std::string, uint64_t> sources, dests;  // worker -> serial at the start
    std::set<std::string> nodes, done;
    absl::Time started, deadline;
    // End-to-end digests of the catch-up's own plan (catch_up.cc): set when its plan is made, before
    // any node runs it; a mismatch fails the catch-up.
    std::optional<DigestBook> digests;
  };
  struct PlanState {
    uint64_t epoch = 0;
    std::shared_ptr<const planner::Plan> plan = std::make_shared<planner::Plan>();
    std::vector<std::string> worker_ids;  // Problem::workers order
    // WorkerRec::serial of each planned worker: a worker registered again since (a restarted
    // rollout) is not the one the plan's versions reached (catch_up.cc).
    std::map<std::string, uint64_t> serials;
    std::set<std::string> nodes;
    uint64_t total_bytes = 0;
    bool installed = false;
    // NVFP4 (magnitudes.cc): what each node's rollouts hold of NVFP4 tensors, made with the plan
    // (outside the lock); null or empty: no version of this plan opens a magnitude book.
    std::shared_ptr<const MagnitudePlan> magnitudes;
  };
  struct Model {
    ::weightbridge::v1::ModelSpec spec;
    std::optional<planner::ModelConfig> config;  // models created from hf_config_json (presets)
    std::shared_ptr<const planner::Inventory> inventory;
    // The inventory as replies carry it, built once at creation and copied into replies outside
    // mu_ (a Kimi-K2 inventory is ~70k tensors: rebuilding it per JoinWorker under the lock held
    // heartbeats for ~0.1 s per worker); inventory_bytes = its encoded size.
    std::shared_ptr<const ::weightbridge::v1::ExplicitInventory> inventory_proto;
    size_t inventory_bytes = 0;
    std::unique_ptr<VersionMachine> machine;
    std::map<std::string, WorkerRec> workers;
    PlanState plan;
    bool plan_dirty = false;
    uint64_t membership = 0;  // bumped whenever plan_dirty is set: a plan of older membership is stale
    bool planning = false;    // the planner thread plans a snapshot of it outside the lock right now
    bool plan_queued = false; // a plan job waits for the planner thread (its snapshot not taken yet)
    bool planned_once = false;
    std::string plan_error;
    uint64_t committing = 0;  // version whose commit the driver is sending
    std::map<uint64_t, std::map<std::string, uint64_t>> progress;  // version -> node -> bytes
    // End-to-end digests (digests.cc): the reports of the version in flight, and the verdicts of
    // recent versions (ClusterStatus, `wbctl versions`).
    std::map<uint64_t, DigestBook> digests;
    std::map<uint64_t, DigestVerdict> verdicts;
    // What landed in each rollout with the newest versions whose digests all came in (and, for the
    // committed version, in late rollouts by its catch-ups): catch-up sources are certified against
    // it (digests.cc, catch_up.cc; pb::CertifyBox). At most kLandedKept versions.
    // Shared, never changed in place (a catch-up's commit replaces it): the catch-up planner
    // reads it outside the lock.
    std::map<uint64_t, std::shared_ptr<const LandedRecord>> landed;
    static constexpr size_t kLandedKept = 2;
    // NVFP4 magnitudes (magnitudes.cc): the book of the version in flight and of the committed one.
    std::map<uint64_t, MagnitudeBook> magnitudes;
    // Lossless deltas per version and node, as the nodes' ReportDone said (by node: a report sent
    // again replaces, never adds); the same recent versions as `verdicts`.
    struct DeltaTally {
      uint64_t stream = 0, replaced = 0, fallback = 0;
    };
    std::map<uint64_t, std::map<std::string, DeltaTally>> deltas;
    double last_seconds = 0;
    uint64_t last_bytes = 0;
    std::optional<CatchUpRun> catch_up;
    double last_catch_up_seconds = 0;
    // AbortVersion rounds of ended catch-up attempts not sent yet: the next attempt waits for them,
    // or its ExecuteVersion could reach a node still holding the ended attempt's execution.
    int catch_up_aborts_unsent = 0;
    // Eviction (see the contract above): the last time a call looked the model up, a worker left
    // or a hold ended (options.clock), and the holds now (threads keeping Model* without mu_).
    absl::Time last_used;
    int holds = 0;

    // `worker` is one of the workers the installed plan (plan.worker_ids) was made of.
    bool InPlan(const std::string& worker) const;
  };
  using Map = std::map<std::string, Model>;

  struct Options {
    int max_models = 256;        // models held at once
    int max_name_bytes = 1024;   // model ids
    int64_t max_reply_bytes = int64_t{4} << 20;  // largest CreateModel / JoinWorker reply
    // Encoded bytes of every model's inventory together (CoordinatorOptions::
    // max_inventory_bytes_total); <= 0: no bound.
    int64_t max_inventory_bytes_total = int64_t{2} << 30;
    // An evictable model must have been untouched this long (CoordinatorOptions::model_idle_grace).
    absl::Duration idle_grace = absl::Seconds(60);
    Clock* clock = Clock::Real();  // every eviction time (tests: FakeClock)
  };
  // Why a model cannot be evicted now (the first that applies), or kEvictable.
  enum class Kept { kEvictable, kWorkers, kVersions, kInUse, kGrace };

  // A hold for the lifetime of a scope that keeps Model* across waits on mu_ (Publish,
  // WaitVersion, ExchangeMagnitudes). Construct it after the MutexLock, so it is destroyed (and
  // the hold released) while mu_ is still held.
  class Held {
   public:
    Held(ModelRegistry& registry, Model& m) : registry_(registry), m_(m) { registry_.Hold(m_); }
    ~Held() { registry_.Release(m_); }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;

   private:
    ModelRegistry& registry_;
    Model& m_;
  };

  explicit ModelRegistry(Options options) : options_(std::move(options)) {}

  // Creates the model of `spec` (true) or finds the same one already there (false).
  absl::StatusOr<bool> Create(const ::weightbridge::v1::ModelSpec& spec);
  // The model a JoinWorker names: created from req.model() if it is not known yet (*created), else
  // checked against the spec the worker declares, if any (ALREADY_EXISTS naming the fields).
  absl::StatusOr<Model*> ForJoin(const ::weightbridge::v1::JoinWorkerRequest& req, bool* created);
  // NOT_FOUND "unknown model <id>". A call's lookup: the model counts as used now.
  absl::StatusOr<Model*> Get(const std::string& model_id);
  Model* Find(const std::string& model_id);
  const Model* Find(const std::string& model_id) const;
  // RESOURCE_EXHAUSTED when a reply with the model's inventory plus `extra` bytes would exceed
  // max_reply_bytes; removes the model if the calling request `created` it. OK for unknown ids.
  absl::Status CheckReplySize(const std::string& model_id, size_t extra, bool created);

  // Records `worker_id` of `m` (replacing a record of that id) with a new serial.
  WorkerRec& AddWorker(Model& m, const std::string& worker_id, WorkerRec rec);
  // A worker's layout (SubmitLayout): resolved (pieces, or a preset of a model made from
  // hf_config_json), validated against the inventory and stored; the resolved layout goes into
  // `resp`. true = the worker's layout changed (the model must be re-planned); false = the same
  // layout again. NOT_FOUND for a worker that has not joined; FAILED_PRECONDITION for a
  // different layout of a worker already in the model's plan.
  // SetLayout does it all in one call (mu_ held throughout: tests, small layouts). The
  // coordinator runs it in three steps so that resolving a big layout (1e6 pieces: seconds) does
  // not hold mu_ (docs/daemon.md "Layouts are resolved outside the lock"):
  //   SnapshotLayout (mu_ held) - what resolving reads, and a hold on the model;
  //   ResolveSnapshot (mu_ NOT held) - converts, resolves, validates; touches no registry state;
  //   ApplyLayout (mu_ held) - stores it if the worker is still the registration the snapshot
  //     saw with the layout it saw; else ABORTED with kLayoutChanged in the message (the caller
  //     takes a new snapshot and resolves again). Always ends the snapshot's hold.
  absl::StatusOr<bool> SetLayout(Model& m, const ::weightbridge::v1::SubmitLayoutRequest& req,
                                 ::weightbridge::v1::SubmitLayoutResponse* resp);
  struct LayoutSnapshot {
    Model* model = nullptr;  // held (Hold) until ApplyLayout or DropSnapshot
    std::shared_ptr<const planner::Inventory> inventory;
    const planner::ModelConfig* config = nullptr;  // m.config (never changes after creation; the hold keeps it)
    planner::Role role = planner::Role::kTrainer;
    uint64_t serial = 0;  // WorkerRec::serial seen
    std::shared_ptr<const ::weightbridge::v1::ResolvedLayout> current;  // the worker's layout then (null: none)
    std::shared_ptr<const StoredPieces> current_pieces;
  };
  struct ResolvedWorkerLayout {
    std::shared_ptr<const ::weightbridge::v1::ResolvedLayout> proto;  // the buffers (WorkerRec::layout_proto)
    std::shared_ptr<const StoredPieces> pieces;
    std::shared_ptr<const planner::PackedLayout> layout;
    // The whole resolved layout, for the answer (SubmitLayoutResponse.layout): moved into it, not
    // kept (the coordinator keeps the forms above).
    std::shared_ptr<::weightbridge::v1::ResolvedLayout> answer;
    bool same = false;  // byte for byte the snapshot's `current`
    int32_t gpu = -1;   // the GPU of its first CUDA buffer (-1: none)
  };
  static constexpr const char* kLayoutChanged = "changed while its layout was resolved";
  absl::StatusOr<LayoutSnapshot> SnapshotLayout(Model& m, const std::string& worker_id);
  static absl::StatusOr<ResolvedWorkerLayout> ResolveSnapshot(const LayoutSnapshot& snap,
                                                              const ::weightbridge::v1::SubmitLayoutRequest& req);
  absl::StatusOr<bool> ApplyLayout(LayoutSnapshot& snap, const ::weightbridge::v1::SubmitLayoutRequest& req,
                                   const ResolvedWorkerLayout& resolved);
  void DropSnapshot(LayoutSnapshot& snap);

  // Holds (see the contract above): Hold under mu_ before releasing it with Model* kept, Release
  // under mu_ once the Model* is no longer used; the model counts as used at the release. Touch:
  // something a call did to the model (a worker dropped) restarts its idle grace.
  void Hold(Model& m) { ++m.holds; }
  void Release(Model& m);
  void Touch(Model& m) { m.last_used = options_.clock->Now(); }
  Kept WhyKept(const Model& m, absl::Time now) const;

  size_t size() const { return models_.size(); }
  // Map view (id -> Model, sorted by id): the driver and status walk every model. Adding and
  // removing models goes through the methods above.
  Map::iterator begin() { return models_.begin(); }
  Map::iterator end() { return models_.end(); }
  Map::const_iterator begin() const { return models_.begin(); }
  Map::const_iterator end() const { return models_.end(); }

 private:
  // At max_models: the evictable model idle longest (end() if none; `refusal` then says why each
  // model is kept). Picked before the new model's inventory is built, removed after it was.
  Map::iterator PickVictim(const std::string& new_id, absl::Status* refusal);

  const Options options_;
  Map models_;
  uint64_t next_worker_serial_ = 1;  // WorkerRec::serial
};

}  // namespace wb::daemon

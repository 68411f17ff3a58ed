#pragma once
// Bookkeeping every transport backend (host_shm, host_tcp, cuda_ipc, nccl) keeps the same way:
// the table of registered/imported regions with their in-use counts, the table of unretired
// batches, and the per-op checks that only look at region records. Backend specifics (how memory
// is reached, how bytes move, how a batch finishes) stay in the backend. Not part of the public
// interface (transport.h).
//
// Thread safety: none here. Each backend guards its tables with its own mutex, exactly as it
// guards the rest of its state; ids are allocated by the backend from one counter shared by
// regions, peers and batches (handles are unique within a transport instance, transport.h).

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace wb::transport {

// What every backend records about a region. Backends derive their region type from it and add
// what they need to reach the bytes (mappings, CUDA handles, ...).
struct RegionRecord {
  bool local = true;            // registered here (true) or imported (false)
  char* base = nullptr;         // where the bytes are in this process (null where unreachable)
  int64_t size = 0;
  std::string label;
  std::string owner_instance;   // instance_id() of the exporter
  uint64_t owner_region_id = 0; // the exporter's id for it (== our id for local regions)
  int pinned = 0;               // unfinished batches referencing it: Release is refused while > 0
};

// Messages shared by the tables below; `kind` is the backend's name ("host_tcp", ...).
absl::Status UnknownRegionError(absl::string_view kind, uint64_t id);
absl::Status RegionInUseError(absl::string_view kind, const RegionRecord& r);
// INVALID_ARGUMENT "<batch_prefix> op <op>: unknown <which> region <id>" (Post validation).
absl::Status UnknownOpRegionError(absl::string_view batch_prefix, size_t op, const char* which, uint64_t id);
absl::Status UnknownBatchError(absl::string_view kind, uint64_t id);

// Two-sided transports (host_tcp, nccl): an op has exactly one local and one imported region, and
// the imported one was exported by the batch's peer. Returns whether the op is a send (its source
// is local); INVALID_ARGUMENT naming `batch_prefix` and the op otherwise.
absl::StatusOr<bool> TwoSidedOpIsSend(const RegionRecord& src, const RegionRecord& dst,
                                      absl::string_view batch_prefix, size_t op, absl::string_view peer_instance);

// The fields of RegionInfo every backend fills from its record (kind and peer are the backend's).
RegionInfo BasicRegionInfo(const RegionRecord& r);

// Regions by handle id. R derives from RegionRecord.
template <typename R>
class RegionRegistry {
 public:
  explicit RegionRegistry(std::string kind) : kind_(std::move(kind)) {}

  // Stores `r` under `id` (allocated by the caller) and returns the stored record.
  R& Add(uint64_t id, R r) {
    R& stored = regions_[id];
    stored = std::move(r);
    return stored;
  }

  // NOT_FOUND "<kind>: unknown region <id>" when absent.
  absl::StatusOr<R*> Find(RegionHandle h) {
    auto it = regions_.find(h.id);
    if (it == regions_.end()) return UnknownRegionError(kind_, h.id);
    return &it->second;
  }
  absl::StatusOr<const R*> Find(RegionHandle h) const {
    auto it = regions_.find(h.id);
    if (it == regions_.end()) return UnknownRegionError(kind_, h.id);
    return &it->second;
  }
  // Null when absent (no error text).
  R* Get(uint64_t id) {
    auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : &it->second;
  }

  // Post validation: INVALID_ARGUMENT "<batch_prefix> op <op>: unknown <which> region <id>".
  absl::StatusOr<R*> FindForOp(RegionHandle h, absl::string_view batch_prefix, size_t op, const char* which) {
    auto it = regions_.find(h.id);
    if (it == regions_.end()) return UnknownOpRegionError(batch_prefix, op, which, h.id);
    return &it->second;
  }

  // FAILED_PRECONDITION naming the region while an unfinished batch references it.
  absl::Status CheckNotInUse(const R& r) const {
    if (r.pinned > 0) return RegionInUseError(kind_, r);
    return absl::OkStatus();
  }

  // Forgets a region that no unfinished batch references (NOT_FOUND / FAILED_PRECONDITION
  // otherwise). For backends with nothing to undo on release.
  absl::Status Release(RegionHandle h) {
    auto it = regions_.find(h.id);
    if (it == regions_.end()) return UnknownRegionError(kind_, h.id);
    if (absl::Status s = CheckNotInUse(it->second); !s.ok()) return s;
    regions_.erase(it);
    return absl::OkStatus();
  }

  void Erase(uint64_t id) { regions_.erase(id); }

  // Pins every id (one count per occurrence). Ids must have been validated by the same critical
  // section (Post), so they are present.
  void Pin(const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) regions_[id].pinned++;
  }
  // Undoes Pin for the ids still present.
  void Unpin(const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) {
      if (auto it = regions_.find(id); it != regions_.end()) it->second.pinned--;
    }
  }

  std::map<uint64_t, R>& all() { return regions_; }
  const std::map<uint64_t, R>& all() const { return regions_; }

 private:
  const std::string kind_;
  std::map<uint64_t, R> regions_;
};

// Unretired batches by id. B has `uint64_t id` and `absl::Status status`. Every batch is added by
// Post and removed by exactly one Wait (transport.h); Poll never retires.
template <typename B>
class BatchTable {
 public:
  explicit BatchTable(std::string kind) : kind_(std::move(kind)) {}

  void Add(std::shared_ptr<B> b) {
    const uint64_t id = b->id;
    batches_[id] = std::move(b);
  }

  // NOT_FOUND "<kind>: unknown batch <id>" for an unknown or retired id.
  absl::StatusOr<std::shared_ptr<B>> Find(BatchId id) const {
    auto it = batches_.find(id.id);
    if (it == batches_.end()) return UnknownBatchError(kind_, id.id);
    return it->second;
  }

  // kRunning until finished(b) holds, then kDone or the batch's error. `finished` is the
  // backend's own completion test (it may update the batch, e.g. query CUDA events).
  template <typename Finished>
  absl::StatusOr<BatchState> Poll(BatchId id, Finished finished) const {
    auto it = batches_.find(id.id);
    if (it == batches_.end()) return UnknownBatchError(kind_, id.id);
    if (!finished(it->second.get())) return BatchState::kRunning;
    if (!it->second->status.ok()) return it->second->status;
    return BatchState::kDone;
  }

  void Retire(uint64_t id) { batches_.erase(id); }

  std::map<uint64_t, std::shared_ptr<B>>& all() { return batches_; }

 private:
  const std::string kind_;
  std::map<uint64_t, std::shared_ptr<B>> batches_;
};

// Peers of the same-node one-sided transports (host_shm, cuda_ipc): a peer is nothing but its
// validated instance id, and connecting twice to one instance yields the same PeerId.
class PeerInstances {
 public:
  explicit PeerInstances(std::string kind) : kind_(std::move(kind)) {}

  // The PeerId already given to `instance` (lowest id), or kNoPeer.
  PeerId Find(absl::string_view instance) const {
    for (const auto& [id, inst] : peers_) {
      if (inst == instance) return PeerId{id};
    }
    return kNoPeer;
  }
  void Add(uint64_t id, std::string instance) { peers_[id] = std::move(instance); }
  // NOT_FOUND "<kind>: unknown peer <id>".
  absl::Status Remove(PeerId peer) {
    if (peers_.erase(peer.id) == 0) return absl::NotFoundError(absl::StrCat(kind_, ": unknown peer ", peer.id));
    return absl::OkStatus();
  }
  // The peer's instance id, or null for an unknown peer.
  const std::string* Instance(PeerId peer) const {
    auto it = peers_.find(peer.id);
    return it == peers_.end() ? nullptr : &it->second;
  }
  // For RegionInfo::peer of an import: the connected peer (highest id) that is `owner`, or kNoPeer.
  PeerId PeerOf(absl::string_view owner) const {
    PeerId found = kNoPeer;
    for (const auto& [id, inst] : peers_) {
      if (inst == owner) found = PeerId{id};
    }
    return found;
  }

 private:
  const std::string kind_;
  std::map<uint64_t, std::string> peers_;  // peer id -> instance id
};

// Rounds Transport::CancelRound cancelled (transport.h), the same in every backend: at least the
// last kMinRememberedCancelledRounds of them; the oldest is forgotten first. The caller's mutex
// guards it and its waiting Connects check Has(round) under it.
class CancelledRounds {
 public:
  // The checks of CancelRound: INVALID_ARGUMENT "<kind> CancelRound: ..." for the empty round or
  // one over kMaxConnectRoundBytes.
  static absl::Status Check(absl::string_view kind, absl::string_view round);
  // What a Connect of a cancelled round returns: CANCELLED naming `kind`, the peer and the round.
  static absl::Status Error(absl::string_view kind, absl::string_view peer, absl::string_view round);

  explicit CancelledRounds(size_t remember = kMinRememberedCancelledRounds) : remember_(remember) {}
  // Remembers `round` (again: it becomes the newest).
  void Add(absl::string_view round);
  bool Has(absl::string_view round) const { return rounds_.count(std::string(round)) > 0; }
  // Forgets `round` (host_tcp also keeps cancelled batch tags and groups here: a tag is consumed by
  // the one Post it refuses).
  void Remove(absl::string_view round);
  size_t size() const { return rounds_.size(); }

 private:
  const size_t remember_;
  std::map<std::string, uint64_t> rounds_;  // round -> sequence number of its latest cancel
  std::map<uint64_t, std::string> order_;   // sequence number -> round, oldest first
  uint64_t next_ = 0;
};

}  // namespace wb::transport

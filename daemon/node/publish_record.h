#pragma once
// A trainer's node remembers, over its own restart, the newest one-step-off / async publish the
// coordinator answered OK for each trainer (status.md item 24; docs/daemon.md "Coordinator
// restart"): a trainer never publishes that number again, so a coordinator that restarted since
// must count it used, or a rollout's Apply of it waits for a version no coordinator runs. The
// node's in-memory record (LocalWorkers::Worker::published_version) is lost when the node daemon
// itself restarts; this file keeps it.
//
// Contract:
//  - One file per node in the node's live state directory (--live_state_dir; LiveMarkers::Open
//    creates and checks it first): "publish-<hash of node id>.record", rewritten whole as a
//    temporary file renamed into place at each change (a reader never sees half of it). Not
//    fsync'ed, as the live markers: it matters while the trainer process lives, which a reboot
//    ends too.
//  - An entry is (model, worker, the trainer's process "<pid>@<start time>", version, the
//    instance of the coordinator that answered). Only the same process registering again after
//    the node restarted inherits it (Find): a new trainer process numbers its versions itself.
//  - Open() reads what an earlier process of this node left; entries whose process is gone (the
//    `alive` check) are dropped, an unreadable or corrupt file is logged and deleted (never a
//    crash, never an error: without the record the node behaves as before it existed).
//  - Bounded: at most kMaxEntries entries (the oldest written dropped first), kMaxFileBytes bytes.
// Thread-safe.

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace wb::daemon::node {

struct PublishEntry {
  std::string model;
  std::string worker;
  std::string process;  // PidWatch::Identity of the trainer's process (never empty here)
  uint64_t version = 0;
  std::string instance;  // the coordinator instance that answered the publish OK (may be empty)
  bool operator==(const PublishEntry& o) const {
    return model == o.model && worker == o.worker && process == o.process && version == o.version && instance == o.instance;
  }
};

class PublishRecord {
 public:
  static constexpr size_t kMaxEntries = 4096;
  static constexpr int64_t kMaxFileBytes = int64_t{2} << 20;

  // Reads node `node_id`'s file in `dir` (which must exist: LiveMarkers::Open made it), keeping the
  // entries whose process `alive` says still runs (null: all).
  static absl::StatusOr<std::unique_ptr<PublishRecord>> Open(const std::string& dir, const std::string& node_id,
                                                             const std::function<bool(const std::string& process)>& alive);

  // Records `e` (replacing the worker's entry; a version below the entry's of the same process is
  // ignored) and rewrites the file. An error means the file was not rewritten (the entry is kept in
  // memory all the same).
  absl::Status Note(const PublishEntry& e);
  // The worker's entry, if any.
  std::optional<PublishEntry> Find(const std::string& model, const std::string& worker) const;
  // Drops the worker's entry (its process left) and rewrites the file.
  void Forget(const std::string& model, const std::string& worker);
  size_t size() const;
  const std::string& path() const { return path_; }

  // The file's text and back (Parse: INVALID_ARGUMENT naming the line on anything odd).
  static std::string Serialize(const std::vector<PublishEntry>& entries);
  static absl::StatusOr<std::vector<PublishEntry>> Parse(const std::string& text);

 private:
  using Key = std::pair<std::string, std::string>;  // (model, worker)
  explicit PublishRecord(std::string path) : path_(std::move(path)) {}
  void PutLocked(const PublishEntry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  // Entries and their order of writing (oldest first), for the bound.
  std::map<Key, std::pair<PublishEntry, std::list<Key>::iterator>> entries_ ABSL_GUARDED_BY(mu_);
  std::list<Key> order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon::node

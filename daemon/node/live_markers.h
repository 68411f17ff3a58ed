#pragma once
// Durable markers of copies into workers' live memory, so that a node daemon killed mid-copy
// (kill -9, OOM, crash) still tells the worker, after it restarted, that its live weights are TORN.
//
// Contract (docs/daemon.md "Live weights: whole or TORN"):
//  - Before the first byte of a copy goes into a worker's live memory, Record() writes a marker
//    file (node, model, worker, the identity of its shm segments, the version being written, the
//    version it is written over) into the node's state directory; the copy is not started when
//    the marker cannot be written. The marker is removed (Clear) when the copy ends whole or wrote
//    nothing, and kept (rewritten with the reason) when the copy failed midway.
//  - Written as a temporary file renamed into place: a reader never sees half a marker. Not
//    fsync'ed on purpose: the markers guard shared memory, which does not survive a reboot either,
//    and the page cache survives the death of the daemon process.
//  - Open() reads the markers an earlier process of this node left (its own node id only; another
//    daemon sharing the directory keeps its own), drops (and deletes) corrupt, oversized and stale
//    ones (a segment that no longer exists or is another file under the same name now) and keeps
//    the rest until Claim(): when the same worker registers the same segments again, its weights
//    are torn. Never crashes on a corrupt file: it is logged and deleted.
//  - Bounded: a marker file is at most kMaxFileBytes, at most kMaxMarkers markers per node
//    (RESOURCE_EXHAUSTED beyond: the copy is not started).
//  - The directory is private: created 0700, refused when owned by another user, open to group or
//    others, or not a directory (a symlink is refused too).
// Thread-safe.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/shm_segment.h"

namespace wb::daemon {

// Which shm segment a live buffer is: its name and the file it names (so a segment unlinked and
// created again under the same name is a different one).
struct SegmentId {
  std::string name;
  uint64_t dev = 0;
  uint64_t ino = 0;
  bool operator==(const SegmentId& o) const { return name == o.name && dev == o.dev && ino == o.ino; }
};

// The identity of `segments` (null entries, CUDA buffers, are skipped), from /dev/shm.
absl::StatusOr<std::vector<SegmentId>> IdentifySegments(const std::vector<std::shared_ptr<transport::ShmSegment>>& segments);

struct LiveMarker {
  std::string node;
  std::string model;
  std::string worker;
  uint64_t writing = 0;  // the version being copied
  uint64_t over = 0;     // the version live memory held before (0: none)
  int64_t daemon_pid = 0;
  std::string reason;  // empty while the copy runs; why it failed once it did
  std::vector<SegmentId> segments;
};

class LiveMarkers {
 public:
  static constexpr int64_t kMaxFileBytes = 16 * 1024;
  static constexpr size_t kMaxMarkers = 4096;

  // The default directory: $STATE_DIRECTORY/live when systemd set it (StateDirectory=), else
  // ${TMPDIR:-/tmp}/weightbridge-<uid>/live.
  static std::string DefaultDir();

  // Creates `dir` (and a missing parent, 0700) or checks it, then reads what an earlier process
  // of node `node_id` left there. Errors name the directory and what to fix.
  static absl::StatusOr<std::unique_ptr<LiveMarkers>> Open(const std::string& dir, const std::string& node_id);

  // Writes `m` (node set to this node's id); replaces the worker's previous marker. An error means
  // nothing was recorded: the caller must not start the copy.
  absl::Status Record(const LiveMarker& m);
  // The worker's marker is rewritten as failed: versions and reason from the live state.
  void MarkFailed(const std::string& worker, uint64_t writing, uint64_t over, const std::string& reason);
  // Removes the marker this process recorded (or claimed) for the worker (none: nothing happens).
  // A leftover of an earlier process is not touched: only Claim decides about it.
  void Clear(const std::string& worker);
  // A marker left by an earlier process for `worker` of `model` on exactly `segments`: returned
  // (it stays on disk until the worker is whole again). A leftover for the worker on other
  // memory is deleted (that memory is not this worker's any more).
  std::optional<LiveMarker> Claim(const std::string& model, const std::string& worker, const std::vector<SegmentId>& segments);

  const std::string& dir() const { return dir_; }
  // Leftovers not claimed yet (status, tests).
  size_t leftovers() const;

  // Text form of a marker and back (Parse: INVALID_ARGUMENT naming the line on anything odd).
  static std::string Serialize(const LiveMarker& m);
  static absl::StatusOr<LiveMarker> Parse(const std::string& text);

 private:
  LiveMarkers(std::string dir, std::string node) : dir_(std::move(dir)), node_(std::move(node)) {}
  std::string PathFor(const std::string& worker) const;
  absl::Status WriteLocked(const LiveMarker& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LoadLeftovers();

  const std::string dir_;
  const std::string node_;
  mutable absl::Mutex mu_;
  std::map<std::string, LiveMarker> current_ ABSL_GUARDED_BY(mu_);    // by worker: markers this process wrote
  std::map<std::string, LiveMarker> leftovers_ ABSL_GUARDED_BY(mu_);  // by worker: an earlier process's
};

}  // namespace wb::daemon

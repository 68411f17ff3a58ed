#pragma once
// The node's side of end-to-end digests (issue 17.4; docs/daemon.md "End-to-end digests"): after a
// version's buckets, the digests of every op of the node's slice that runs here. Pure over plain
// memory (no transports, no locks); the executor hands it the host address of each local region.

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/digest/digest.h"
#include "daemon/node/exec_plan.h"

namespace wb::digest {

// A local memory region of a version (RegionKey "w<i>.b<j>" or "g"): its host bytes, or
// host == nullptr for device memory (GPU staging, a worker's CUDA buffer), which is not digested.
struct RegionBytes {
  const uint8_t* host = nullptr;
  int64_t size = 0;
};

struct OpDigests {
  std::map<uint32_t, Digest> source;  // op index -> digest of what it read (ops this node sends)
  std::map<uint32_t, Digest> landed;  // op index -> digest of what landed (ops this node receives)
  int64_t bytes = 0;                  // bytes hashed (distinct boxes)
  int64_t skipped_sides = 0;          // op sides in device memory (no digest)
};

// For every op of `slice` with a side on node `me`: the source digest over the box it reads when
// its source is local, the landed digest over its destination box when its destination is local
// (a same-node op: both). Ops in `at_commit` (same-node relays the sync commit copies straight from
// the source rollout's staging into live memory; the buckets skipped them) get both from their
// source, which is what the commit copies. Identical boxes are hashed once. INTERNAL for a region
// missing from `regions` or a box outside its region (a bug, never a silent skip);
// DEADLINE_EXCEEDED past `deadline`.
absl::StatusOr<OpDigests> DigestLocalOps(const daemon::node::Slice& slice, const std::string& me, const std::set<uint32_t>& at_commit,
                                         const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline);

}  // namespace wb::digest

#pragma once
// Catch-up sources certified against the committed version's own digests (docs/daemon.md
// "Catch-up"; pb::CertifyBox). A catch-up serves late rollouts from rollouts that hold the
// committed version v; its own end-to-end digests prove that what landed is what the sources read,
// not that the sources still hold v (their memory written since, a torn copy, an engine that
// changed its weights in place). The coordinator therefore sends, with the catch-up slice, boxes of
// each source with the digest v had when it landed there (v's plan, or an earlier catch-up), and the
// source's node hashes them where the catch-up reads them before its commit. Pure over plain memory.

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/digest/op_digests.h"
#include "daemon/node/exec_plan.h"

namespace wb::digest {

struct CertifyOutcome {
  int64_t boxes = 0;    // local entries hashed and matching
  int64_t bytes = 0;    // bytes hashed
  int64_t skipped = 0;  // local entries in device memory (not hashed)
  // Sources with a box that differs (worker ids, sorted): they no longer hold the version. Empty:
  // every hashed box matched.
  std::vector<std::string> stale;
  std::string first_mismatch;  // the first differing box, in words (worker, node, tensor, box, digests, origin)
};

// Hashes every entry of `slice.certify` whose worker runs on node `me`, over `regions` (the
// version's regions: the source's committed staging or live buffers, as the catch-up reads them)
// and compares it with the entry's digest; differences are in the outcome (`stale`,
// `first_mismatch`). INVALID_ARGUMENT for an entry outside the slice (worker, piece, tensor, a box
// outside its piece); DEADLINE_EXCEEDED past `deadline`.
absl::StatusOr<CertifyOutcome> CertifySources(const daemon::node::Slice& slice, const std::string& me,
                                              const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline);

// CertifySources on a thread of its own, beside a catch-up's buckets (both only read the sources).
// `slice` and the memory behind `regions` must outlive Finish or the destructor, which joins.
class SourceCertification {
 public:
  SourceCertification() = default;
  ~SourceCertification();
  SourceCertification(const SourceCertification&) = delete;
  SourceCertification& operator=(const SourceCertification&) = delete;

  void Start(const daemon::node::Slice& slice, std::string me, std::map<std::string, RegionBytes> regions, int threads,
             absl::Time deadline);
  bool started() const { return started_; }
  // Waits for the hashing and returns CertifySources' answer. Call once, after Start.
  absl::StatusOr<CertifyOutcome> Finish();

 private:
  bool started_ = false;
  std::thread thread_;
  absl::StatusOr<CertifyOutcome> result_;  // written by thread_ before it ends
};

}  // namespace wb::digest

#pragma once
// The coordinator's side of end-to-end digests (issue 17.4; docs/daemon.md "End-to-end digests").
// Per version, the digests every node reported in ReportDone: for each op of the plan, the digest
// of what its source read (reported by the sending node) and of what landed (reported by the
// receiving node; both by the one node of a same-node op). A pair that differs is a mismatch: the
// version must not commit, and the error names the op's tensor, box, source and destination
// worker (and their nodes). A catch-up (Kind::kCatchUp) is checked the same way; its mismatch
// aborts the catch-up, not the committed version. Once every node reported, the version is `verified` when every op of
// the plan has both digests and they match (ops a node could not digest - device memory on a GPU
// path - leave it unverified, never failed).
//
// Not thread-safe (the coordinator keeps one per version in flight under its lock).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

struct DigestVerdict {
  bool verified = false;       // every op of the plan has matching digests on both sides
  uint32_t ops_verified = 0;   // ops with matching digests on both sides
  uint32_t ops_total = 0;      // ops of the plan
};

// What landed in one rollout with a matching or unverifiable pair of digests: the digest of `box`
// of `tensor` in canonical element order, as the receiving node computed it over what landed (after
// decoding a delta; canonical shadows of receiver-quantised pieces), or, for a sender-quantised op
// (`quantized`), over the box's quantised elements and the scales of its blocks
// (node::DigestSenderQuantized). Layout independent, so it certifies that box wherever the rollout
// holds it later in the same form (daemon/digest/certify.h).
struct LandedBox {
  int32_t tensor = -1;
  planner::Box box;
  uint64_t digest = 0;
  uint32_t op = 0;             // the op of the book's plan it landed with
  bool from_catch_up = false;  // the book was a catch-up's
  bool quantized = false;      // the digest covers quantised bytes (a sender-quantised op)
  // With `quantized`: the rollout's node quantised the piece `box` itself (receiver-side;
  // ReportDoneRequest.quantized_pieces), so `op` names no op.
  bool quantized_here = false;
};

// Per rollout worker id, what landed in it (the coordinator's record of a version).
using LandedRecord = std::map<std::string, std::vector<LandedBox>>;

class DigestBook {
 public:
  // Quantised pieces (ReportDoneRequest.quantized_pieces) one book keeps at most.
  static constexpr size_t kMaxQuantizedPieces = size_t{1} << 20;

  // What the book checks: a version, or a catch-up (catch_up.h: the committed version once more,
  // from the rollouts that hold it to the late ones, on its own plan). Only the wording of a
  // mismatch differs: what is aborted, and what stays.
  enum class Kind { kVersion, kCatchUp };

  // `plan` and `worker_ids` (Problem::workers order, i.e. TransferOp worker indices) are the plan
  // the version runs on; op indices are the plan's ops in bucket order (as the slicer numbers them).
  DigestBook(std::string model_id, uint64_t version, std::shared_ptr<const planner::Plan> plan, std::vector<std::string> worker_ids,
             std::shared_ptr<const planner::Inventory> inventory, std::map<std::string, std::string> node_of,
             Kind kind = Kind::kVersion);

  // Records one node's digests. DATA_LOSS naming the first op whose two digests differ (tensor,
  // box, source worker and node, destination worker and node, both digests); INVALID_ARGUMENT for
  // an op index outside the plan, or a second, different digest of one side of an op, or a
  // quantised piece (quantized_pieces) of a worker that is not one of the plan's on that node, of
  // no tensor box of the inventory, reported again with another digest, or past
  // kMaxQuantizedPieces.
  absl::Status Add(const pb::ReportDoneRequest& report);

  // After every node reported.
  DigestVerdict Verdict() const;
  // Per destination worker id, what landed in it (ops with a landed digest whose source digest
  // matched or was not taken; sender-quantised ops marked `quantized`, their digests cover the
  // quantised bytes; ops into a gather staging left out), then the pieces its node quantised
  // (`quantized`, `quantized_here`).
  LandedRecord LandedByWorker() const;

 private:
  std::string DescribeOp(uint32_t index) const;
  absl::Status Record(std::map<uint32_t, uint64_t>& side, const char* what, const pb::OpDigest& d, const std::string& node);

  std::string model_id_;
  uint64_t version_ = 0;
  Kind kind_ = Kind::kVersion;
  std::shared_ptr<const planner::Plan> plan_;
  std::vector<std::string> worker_ids_;
  std::shared_ptr<const planner::Inventory> inventory_;
  std::map<std::string, std::string> node_of_;  // worker id -> node id
  std::vector<const planner::TransferOp*> ops_;  // by op index
  std::map<uint32_t, uint64_t> source_, landed_;
  // (worker id, tensor, box) -> the piece's record, as reported (quantized_pieces); at most
  // kMaxQuantizedPieces per book.
  std::map<std::tuple<std::string, int32_t, std::vector<int64_t>, std::vector<int64_t>>, LandedBox> quantized_pieces_;
};

}  // namespace wb::daemon

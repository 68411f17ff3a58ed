#include "daemon/coordinator/digest_book.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/box.h"
#include "proto/convert.h"

namespace wb::daemon {

DigestBook::DigestBook(std::string model_id, uint64_t version, std::shared_ptr<const planner::Plan> plan, std::vector<std::string> worker_ids,
                       std::shared_ptr<const planner::Inventory> inventory, std::map<std::string, std::string> node_of, Kind kind)
    : model_id_(std::move(model_id)),
      version_(version),
      kind_(kind),
      plan_(std::move(plan)),
      worker_ids_(std::move(worker_ids)),
      inventory_(std::move(inventory)),
      node_of_(std::move(node_of)) {
  if (plan_ == nullptr) return;
  for (const planner::Bucket& b : plan_->buckets) {
    for (const planner::TransferOp& op : b.ops) ops_.push_back(&op);
  }
}

std::string DigestBook::DescribeOp(uint32_t index) const {
  const planner::TransferOp& op = *ops_[index];
  auto worker = [&](int32_t w) {
    const std::string id = w >= 0 && static_cast<size_t>(w) < worker_ids_.size() ? worker_ids_[static_cast<size_t>(w)] : absl::StrCat("#", w);
    auto n = node_of_.find(id);
    return absl::StrCat("worker ", id, n != node_of_.end() ? absl::StrCat(" (node ", n->second, ")") : std::string());
  };
  const std::string tensor = inventory_ != nullptr && op.tensor >= 0 && static_cast<size_t>(op.tensor) < inventory_->tensors.size()
                                 ? inventory_->tensors[static_cast<size_t>(op.tensor)].name
                                 : absl::StrCat("#", op.tensor);
  return absl::StrCat("tensor ", tensor, " box ", planner::BoxToString(op.box), " from ", worker(op.src_worker), " to ", worker(op.dst_worker),
                      " (op ", index, ")");
}

absl::Status DigestBook::Record(std::map<uint32_t, uint64_t>& side, const char* what, const pb::OpDigest& d, const std::string& node) {
  if (d.op() >= ops_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("node ", node, " reported a ", what, " digest of op ", d.op(), " of model ", model_id_,
                                                   " version ", version_, ", but its plan has ", ops_.size(), " ops"));
  }
  auto [it, inserted] = side.emplace(d.op(), d.digest());
  if (!inserted && it->second != d.digest()) {
    return absl::InvalidArgumentError(absl::StrCat("node ", node, " reported a second, different ", what, " digest of ", DescribeOp(d.op()),
                                                   " in model ", model_id_, " version ", version_));
  }
  return absl::OkStatus();
}

absl::Status DigestBook::Add(const pb::ReportDoneRequest& report) {
  for (const pb::QuantizedPieceDigest& q : report.quantized_pieces()) {
    auto what = [&] {
      return absl::StrCat("node ", report.node_id(), " reported a quantised piece of worker ", q.worker_id(), " in model ", model_id_,
                          " version ", version_);
    };
    auto node = node_of_.find(q.worker_id());
    if (node == node_of_.end() || node->second != report.node_id() ||
        std::find(worker_ids_.begin(), worker_ids_.end(), q.worker_id()) == worker_ids_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ", which is no worker of the plan on that node"));
    }
    if (inventory_ == nullptr || q.tensor() < 0 || static_cast<size_t>(q.tensor()) >= inventory_->tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": tensor ", q.tensor(), " is not in the inventory"));
    }
    absl::StatusOr<planner::Box> box = convert::FromProto(q.box());
    if (!box.ok() || !planner::BoxInside(*box, inventory_->tensors[static_cast<size_t>(q.tensor())].shape)) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": not a box of tensor ", inventory_->tensors[static_cast<size_t>(q.tensor())].name));
    }
    auto key = std::make_tuple(q.worker_id(), q.tensor(), box->begin, box->end);
    auto it = quantized_pieces_.find(key);
    if (it != quantized_pieces_.end()) {
      if (it->second.digest != q.digest()) {
        return absl::InvalidArgumentError(absl::StrCat(what(), ": box ", planner::BoxToString(*box), " of tensor ",
                                                       inventory_->tensors[static_cast<size_t>(q.tensor())].name,
                                                       " again with another digest"));
      }
      continue;  // the same report again
    }
    if (quantized_pieces_.size() >= kMaxQuantizedPieces) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": more than ", kMaxQuantizedPieces, " quantised pieces in one version"));
    }
    quantized_pieces_.emplace(std::move(key), LandedBox{q.tensor(), std::move(*box), q.digest(), 0, kind_ == Kind::kCatchUp, true, true});
  }
  for (const pb::OpDigest& d : report.source_digests()) {
    if (absl::Status s = Record(source_, "source", d, report.node_id()); !s.ok()) return s;
  }
  for (const pb::OpDigest& d : report.landed_digests()) {
    if (absl::Status s = Record(landed_, "landed", d, report.node_id()); !s.ok()) return s;
  }
  // Only pairs this report completed can newly differ, but checking all is cheap and simpler.
  for (const auto& [op, sent] : source_) {
    auto l = landed_.find(op);
    if (l == landed_.end() || l->second == sent) continue;
    if (kind_ == Kind::kCatchUp) {
      return absl::DataLossError(absl::StrFormat(
          "end-to-end digest mismatch in the catch-up of model %s version %d: %s: the source read digest %016x but what landed has "
          "digest %016x; the catch-up is aborted (the late rollouts keep what they had)",
          model_id_, version_, DescribeOp(op), sent, l->second));
    }
    return absl::DataLossError(absl::StrFormat(
        "end-to-end digest mismatch in model %s version %d: %s: the source read digest %016x but what landed has digest %016x; "
        "the version is aborted (the previous version stays whole in live memory)",
        model_id_, version_, DescribeOp(op), sent, l->second));
  }
  return absl::OkStatus();
}

LandedRecord DigestBook::LandedByWorker() const {
  LandedRecord out;
  for (const auto& [index, digest] : landed_) {
    if (index >= ops_.size()) continue;
    const planner::TransferOp& op = *ops_[index];
    if (op.dst_piece < 0 || op.dst_worker < 0 || static_cast<size_t>(op.dst_worker) >= worker_ids_.size()) continue;
    auto sent = source_.find(index);
    if (sent != source_.end() && sent->second != digest) continue;
    out[worker_ids_[static_cast<size_t>(op.dst_worker)]].push_back(
        {op.tensor, op.box, digest, index, kind_ == Kind::kCatchUp, op.sender_quantized});
  }
  for (const auto& [key, l] : quantized_pieces_) out[std::get<0>(key)].push_back(l);
  return out;
}

DigestVerdict DigestBook::Verdict() const {
  DigestVerdict v;
  v.ops_total = static_cast<uint32_t>(ops_.size());
  for (const auto& [op, sent] : source_) {
    auto l = landed_.find(op);
    if (l != landed_.end() && l->second == sent) ++v.ops_verified;
  }
  v.verified = v.ops_total > 0 && v.ops_verified == v.ops_total;
  return v;
}

}  // namespace wb::daemon

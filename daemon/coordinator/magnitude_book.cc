#include "daemon/coordinator/magnitude_book.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::daemon {

MagnitudeBook::MagnitudeBook(std::string model_id, uint64_t version, std::set<std::string> nodes,
                             std::shared_ptr<const planner::Inventory> inventory)
    : model_id_(std::move(model_id)), version_(version), nodes_(std::move(nodes)), inventory_(std::move(inventory)) {}

std::vector<std::string> MagnitudeBook::missing() const {
  std::vector<std::string> out;
  for (const std::string& n : nodes_) {
    if (reported_.count(n) == 0) out.push_back(n);
  }
  return out;
}

absl::Status MagnitudeBook::Add(const pb::ExchangeMagnitudesRequest& req) {
  if (nodes_.count(req.node_id()) == 0) {
    return absl::FailedPreconditionError(absl::StrCat("node ", req.node_id(), " holds no NVFP4 rollout piece of version ", version_,
                                                      " of model ", model_id_, " in its plan"));
  }
  if (index_.empty()) {
    for (size_t i = 0; i < inventory_->tensors.size(); ++i) index_.emplace(inventory_->tensors[i].name, static_cast<int32_t>(i));
  }
  // Checked whole before anything is recorded: a bad report changes nothing.
  std::vector<std::pair<int32_t, const pb::TensorMagnitude*>> checked;
  for (const pb::TensorMagnitude& t : req.parts()) {
    auto it = index_.find(t.tensor());
    if (it == index_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("node ", req.node_id(), ": magnitude of unknown tensor '", t.tensor().substr(0, 200),
                                                     "' (model ", model_id_, ")"));
    }
    const std::vector<int64_t>& shape = inventory_->tensors[static_cast<size_t>(it->second)].shape;
    if (static_cast<size_t>(t.boxes_size()) > kMaxBoxesPerTensor) {
      return absl::InvalidArgumentError(absl::StrCat("node ", req.node_id(), ": tensor ", t.tensor(), ": ", t.boxes_size(),
                                                     " boxes in one magnitude report (at most ", kMaxBoxesPerTensor, ")"));
    }
    for (const pb::Box& b : t.boxes()) {
      bool ok = static_cast<size_t>(b.begin_size()) == shape.size() && static_cast<size_t>(b.end_size()) == shape.size();
      for (size_t d = 0; ok && d < shape.size(); ++d) ok = 0 <= b.begin(d) && b.begin(d) < b.end(d) && b.end(d) <= shape[d];
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat("node ", req.node_id(), ": tensor ", t.tensor(), ": box ", b.ShortDebugString(),
                                                       " is not inside its shape"));
      }
    }
    checked.push_back({it->second, &t});
  }
  if (parts_.use_count() > 1) parts_ = std::make_shared<Parts>(*parts_);  // a snapshot is being read
  for (const auto& [tensor, t] : checked) {
    Part& p = (*parts_)[tensor];
    const float a = t->amax();
    if (!p.any || std::isnan(a) || (!std::isnan(p.amax) && a > p.amax)) p.amax = a;  // NaN sticks
    p.any = true;
    for (const pb::Box& b : t->boxes()) {
      if (p.boxes.size() >= kMaxBoxesPerTensor) break;
      p.boxes.insert({{b.begin().begin(), b.begin().end()}, {b.end().begin(), b.end().end()}});
    }
  }
  reported_.insert(req.node_id());
  return absl::OkStatus();
}

void MagnitudeBook::Answer(const Parts& parts, const planner::Inventory& inventory, pb::ExchangeMagnitudesResponse* resp) {
  for (const auto& [tensor, p] : parts) {
    const planner::TensorSpec& spec = inventory.tensors[static_cast<size_t>(tensor)];
    std::vector<planner::Box> boxes;
    boxes.reserve(p.boxes.size());
    for (const auto& [begin, end] : p.boxes) boxes.push_back({begin, end});
    pb::TensorMagnitude* t = resp->add_tensors();
    t->set_tensor(spec.name);
    t->set_amax(p.amax);
    t->set_whole(planner::BoxesCover(boxes, spec.shape));
  }
}

std::set<std::string> MagnitudeNodes(const std::vector<MagnitudeWorker>& workers) {
  std::set<std::string> out;
  for (const MagnitudeWorker& w : workers) {
    if (w.rollout && w.layout != nullptr && planner::HasGlobalScales(*w.layout)) out.insert(w.node);
  }
  return out;
}

}  // namespace wb::daemon

#include "daemon/coordinator/magnitude_book.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::daemon {

std::shared_ptr<const MagnitudePlan> MakeMagnitudePlan(const std::vector<MagnitudeWorker>& workers, const planner::Inventory& inventory) {
  auto plan = std::make_shared<MagnitudePlan>();
  for (const MagnitudeWorker& w : workers) {
    if (!w.rollout || w.layout == nullptr || !w.layout->HasGlobalScales()) continue;
    std::map<int32_t, std::vector<planner::Box>>& held = plan->held[w.node];
    for (size_t i = 0; i < w.layout->num_pieces(); ++i) {
      if (w.layout->global_scale_offset_bytes(i) < 0) continue;  // unquantised: -1 too
      const int32_t t = w.layout->tensor(i);
      if (t < 0 || static_cast<size_t>(t) >= inventory.tensors.size()) continue;  // validated layouts: never
      held[t].push_back(w.layout->box(i));
      plan->index.emplace(inventory.tensors[static_cast<size_t>(t)].name, t);
    }
  }
  return plan;
}

MagnitudeBook::MagnitudeBook(std::string model_id, uint64_t version, std::shared_ptr<const MagnitudePlan> plan)
    : model_id_(std::move(model_id)), version_(version), plan_(std::move(plan)) {}

std::vector<std::string> MagnitudeBook::missing() const {
  std::vector<std::string> out;
  for (const auto& [node, held] : plan_->held) {
    if (reported_.count(node) == 0) out.push_back(node);
  }
  return out;
}

MagnitudeBook::Snap MagnitudeBook::Snapshot() const {
  shared_ = true;
  return {parts_, plan_};
}

absl::Status MagnitudeBook::Add(const pb::ExchangeMagnitudesRequest& req) {
  auto held = plan_->held.find(req.node_id());
  if (held == plan_->held.end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", req.node_id(), " holds no NVFP4 rollout piece of version ", version_,
                                                      " of model ", model_id_, " in its plan"));
  }
  // Checked whole before anything is recorded: a bad report changes nothing.
  std::vector<std::pair<int32_t, float>> checked;
  checked.reserve(static_cast<size_t>(req.parts_size()));
  for (const pb::TensorMagnitude& t : req.parts()) {
    auto it = plan_->index.find(t.tensor());
    if (it == plan_->index.end() || held->second.count(it->second) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("node ", req.node_id(), " holds no NVFP4 piece of tensor '", t.tensor().substr(0, 200),
                                                     "' (model ", model_id_, ", version ", version_, ")"));
    }
    // A largest magnitude is >= 0; NaN stays (a NaN element makes the scale NaN, as ModelOpt's
    // amax does), but an infinite or negative one would set every other node's scale wrong.
    if (std::isinf(t.amax()) || (!std::isnan(t.amax()) && std::signbit(t.amax()))) {
      return absl::InvalidArgumentError(absl::StrCat("node ", req.node_id(), ": amax ", t.amax(), " of tensor '", t.tensor().substr(0, 200),
                                                     "' is not a finite magnitude >= 0"));
    }
    checked.push_back({it->second, t.amax()});
  }
  if (shared_) {
    parts_ = std::make_shared<Parts>(*parts_);  // a snapshot may still be read outside the lock
    shared_ = false;
  }
  for (const auto& [tensor, a] : checked) {
    Part& p = (*parts_)[tensor];
    const bool first = p.nodes.empty();
    if (first || std::isnan(a) || (!std::isnan(p.amax) && a > p.amax)) p.amax = a;  // NaN sticks
    p.nodes.insert(req.node_id());
  }
  reported_.insert(req.node_id());
  return absl::OkStatus();
}

void MagnitudeBook::MarkDone(const std::string& node) {
  if (plan_->held.count(node) > 0) reported_.insert(node);
}

void MagnitudeBook::Answer(const Snap& snap, const planner::Inventory& inventory, pb::ExchangeMagnitudesResponse* resp) {
  for (const auto& [tensor, p] : *snap.parts) {
    std::vector<planner::Box> boxes;
    for (const std::string& node : p.nodes) {
      const auto& held = snap.plan->held.at(node).at(tensor);
      boxes.insert(boxes.end(), held.begin(), held.end());
    }
    const planner::TensorSpec& spec = inventory.tensors[static_cast<size_t>(tensor)];
    pb::TensorMagnitude* t = resp->add_tensors();
    t->set_tensor(spec.name);
    t->set_amax(p.amax);
    t->set_whole(planner::BoxesCover(boxes, spec.shape));
  }
}

}  // namespace wb::daemon

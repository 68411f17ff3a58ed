#include "daemon/coordinator/certify_boxes.h"

#include <optional>
#include <set>

#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/sender_quant.h"
#include "proto/convert.h"

namespace wb::daemon {

CertifyCount AddCertifyBoxes(const planner::Plan& plan, const SliceInput& in, const std::map<std::string, std::vector<LandedBox>>& landed,
                             std::map<std::string, pb::PlanSlice>* by_node) {
  CertifyCount count;
  // Per source worker index and tensor: the boxes the plan reads from it.
  std::map<int32_t, std::map<int32_t, std::vector<const planner::Box*>>> reads;
  for (const planner::Bucket& b : plan.buckets) {
    for (const planner::TransferOp& op : b.ops) {
      if (op.src_worker < 0 || static_cast<size_t>(op.src_worker) >= in.workers.size()) continue;
      if (in.workers[static_cast<size_t>(op.src_worker)].role != planner::Role::kTrainer) continue;
      reads[op.src_worker][op.tensor].push_back(&op.box);
    }
  }
  for (const auto& [w, by_tensor] : reads) {
    const SliceWorker& source = in.workers[static_cast<size_t>(w)];
    auto record = landed.find(source.id);
    auto slice = by_node->find(source.node);
    if (record == landed.end() || slice == by_node->end() || source.layout == nullptr) {
      ++count.uncovered_sources;
      continue;
    }
    const planner::PackedLayout& pieces = *source.layout;
    int64_t added = 0;
    for (const LandedBox& l : record->second) {
      auto t = by_tensor.find(l.tensor);
      if (t == by_tensor.end()) continue;
      bool read = false;
      for (const planner::Box* r : t->second) read = read || planner::Intersect(*r, l.box).has_value();
      if (!read) continue;
      for (size_t p = 0; p < pieces.num_pieces(); ++p) {
        // A canonical digest certifies an unquantised piece; a sender-quantised one a quantised
        // piece holding the box in whole blocks (the source's node checks the format's grid).
        if (pieces.tensor(p) != l.tensor || pieces.quantized(p) != l.quantized || !pieces.BoxContains(p, l.box)) {
          continue;
        }
        // A quantised digest certifies whole blocks of a format senders produce, as the source's
        // node checks (digest::CertifySources); anything else would fail the catch-up, not name a
        // stale source: such a record certifies nothing.
        if (l.quantized) {
          const std::optional<planner::Quantization> q = pieces.quant(p);
          if (in.inventory == nullptr || static_cast<size_t>(l.tensor) >= in.inventory->tensors.size() || !planner::SenderCanQuantize(*q) ||
              !planner::BoxOnBlockGrid(l.box, in.inventory->tensors[static_cast<size_t>(l.tensor)].shape, q->block)) {
            continue;
          }
        }
        pb::CertifyBox* c = slice->second.add_certify();
        c->set_worker(static_cast<uint32_t>(w));
        c->set_piece(static_cast<int32_t>(p));
        c->set_tensor(l.tensor);
        convert::ToProto(l.box, c->mutable_box());
        c->set_digest(l.digest);
        c->set_version_op(l.op);
        c->set_from_catch_up(l.from_catch_up);
        c->set_quantized(l.quantized);
        c->set_quantized_here(l.quantized_here);
        ++added;
        break;
      }
    }
    count.boxes += added;
    if (added > 0) ++count.sources;
  }
  return count;
}

}  // namespace wb::daemon

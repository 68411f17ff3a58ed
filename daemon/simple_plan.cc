#include "daemon/simple_plan.h"

#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "planner/box.h"

namespace wb::daemon {

absl::StatusOr<planner::Plan> SimplePlan(const planner::Problem& problem, planner::Strategy strategy) {
  planner::Plan plan;
  plan.strategy = strategy;
  planner::Bucket bucket;
  uint64_t fp = 1469598103934665603ull;
  auto mix = [&](int64_t x) { fp = (fp ^ static_cast<uint64_t>(x)) * 1099511628211ull; };
  for (size_t d = 0; d < problem.workers.size(); ++d) {
    const planner::Worker& dst = problem.workers[d];
    if (dst.role != planner::Role::kRollout) continue;
    for (size_t dp = 0; dp < dst.layout.pieces.size(); ++dp) {
      const planner::Piece& dpiece = dst.layout.pieces[dp];
      const planner::TensorSpec& t = problem.inventory.tensors[dpiece.tensor];
      int64_t covered = 0;
      std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>> seen;
      for (size_t s = 0; s < problem.workers.size(); ++s) {
        const planner::Worker& src = problem.workers[s];
        if (src.role != planner::Role::kTrainer) continue;
        for (size_t sp = 0; sp < src.layout.pieces.size(); ++sp) {
          const planner::Piece& spiece = src.layout.pieces[sp];
          if (spiece.tensor != dpiece.tensor) continue;
          auto box = planner::Intersect(spiece.box, dpiece.box);
          if (!box || !seen.insert({box->begin, box->end}).second) continue;
          planner::TransferOp op;
          op.src_worker = static_cast<int32_t>(s);
          op.dst_worker = static_cast<int32_t>(d);
          op.src_piece = static_cast<int32_t>(sp);
          op.dst_piece = static_cast<int32_t>(dp);
          op.tensor = dpiece.tensor;
          op.box = *box;
          op.bytes = planner::BoxVolume(*box) * planner::DTypeSize(t.dtype);
          op.route = src.node != dst.node ? planner::Route::kInterNode
                     : src.gpu != dst.gpu ? planner::Route::kIntraNode
                                          : planner::Route::kSameGpu;
          covered += planner::BoxVolume(*box);
          (op.route == planner::Route::kInterNode ? plan.stats.bytes_inter_node : plan.stats.bytes_intra_node) += op.bytes;
          for (int64_t x : {int64_t{op.src_worker}, int64_t{op.dst_worker}, op.bytes}) mix(x);
          for (int64_t x : op.box.begin) mix(x);
          bucket.ops.push_back(std::move(op));
        }
      }
      if (covered != planner::BoxVolume(dpiece.box)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " box ", planner::BoxToString(dpiece.box),
                                                       " of worker ", dst.id, ": sources hold ", covered, " of ",
                                                       planner::BoxVolume(dpiece.box), " elements"));
      }
    }
  }
  plan.stats.num_ops = static_cast<int64_t>(bucket.ops.size());
  plan.stats.complete = true;
  plan.buckets.push_back(std::move(bucket));
  plan.fingerprint = absl::StrCat(absl::Hex(fp, absl::kZeroPad16));
  return plan;
}

}  // namespace wb::daemon

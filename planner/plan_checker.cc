#include "planner/plan_checker.h"

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::planner {
namespace {

// Calls fn(offset) for each element of `box` with its row-major offset inside `outer`.
template <typename Fn>
void ForEachElement(const Box& outer, const Box& box, Fn&& fn) {
  const size_t rank = box.begin.size();
  if (rank == 0) {
    fn(int64_t{0});
    return;
  }
  if (BoxEmpty(box)) return;
  std::vector<int64_t> idx(box.begin);
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d-- > 0;) stride[d] = stride[d + 1] * (outer.end[d + 1] - outer.begin[d + 1]);
  while (true) {
    int64_t off = 0;
    for (size_t d = 0; d < rank; ++d) off += (idx[d] - outer.begin[d]) * stride[d];
    fn(off);
    size_t d = rank;
    while (d-- > 0) {
      if (++idx[d] < box.end[d]) break;
      idx[d] = box.begin[d];
      if (d == 0) return;
    }
  }
}

// Sender-side quantisation: a flagged op moves exactly the quantised bytes of a box on the
// destination piece's block grid; all ops into a piece agree; a relay reads a piece in the form it
// was delivered (quantised bytes only into the same format, canonical bytes only from a shadow).
absl::Status CheckWireBytes(const Problem& p, const TransferOp& op,
                            std::map<std::pair<int32_t, int32_t>, int>& state, const std::string& where) {
  const Worker& sw = p.workers[op.src_worker];
  const Worker& dw = p.workers[op.dst_worker];
  const Piece* dp = op.dst_piece >= 0 ? &dw.layout.pieces[op.dst_piece] : nullptr;
  const Piece* sp = sw.role == Role::kRollout && op.src_piece >= 0 ? &sw.layout.pieces[op.src_piece] : nullptr;
  // A quantised source piece (a catch-up from quantised rollouts: PlanOptions::quantized_sources)
  // holds no canonical bytes: it only serves copies of its quantised bytes in its own format.
  const Piece* qsrc = sw.role == Role::kTrainer && op.src_piece >= 0 && sw.layout.pieces[op.src_piece].quant.has_value()
                          ? &sw.layout.pieces[op.src_piece]
                          : nullptr;
  if (qsrc != nullptr && (!op.sender_quantized || dp == nullptr || !dp->quant.has_value() || !SameQuantFormat(*qsrc->quant, *dp->quant))) {
    return absl::InternalError(where + "a quantised source piece serves an op that is not a copy of its quantised bytes in its format");
  }
  if (!op.sender_quantized) {
    if (op.wire_bytes != 0 && op.wire_bytes != op.bytes) return absl::InternalError(where + "wire bytes of a canonical op differ from its bytes");
  } else {
    if (dp == nullptr || !dp->quant.has_value()) return absl::InternalError(where + "sender-quantised op into an unquantised piece");
    if (!BoxOnBlockGrid(op.box, p.inventory.tensors[op.tensor].shape, dp->quant->block)) {
      return absl::InternalError(absl::StrCat(where, "sender-quantised box ", BoxToString(op.box), " cuts a block"));
    }
    if (op.wire_bytes != QuantizedBoxBytes(op.box, *dp->quant)) return absl::InternalError(where + "wrong wire bytes");
    if (sp != nullptr && (!sp->quant.has_value() || !SameQuantFormat(*sp->quant, *dp->quant))) {
      return absl::InternalError(where + "quantised relay between different formats");
    }
  }
  if (sp != nullptr) {
    auto it = state.find({op.src_worker, op.src_piece});
    if (it != state.end() && it->second != (op.sender_quantized ? 1 : 0)) {
      return absl::InternalError(where + (op.sender_quantized ? "quantised relay from a piece that received canonical bytes"
                                                              : "canonical relay from a piece that received quantised bytes"));
    }
  }
  if (dp != nullptr) {
    auto [it, fresh] = state.emplace(std::make_pair(op.dst_worker, op.dst_piece), op.sender_quantized ? 1 : 0);
    if (!fresh && it->second != (op.sender_quantized ? 1 : 0)) {
      return absl::InternalError(where + "sender-quantised and canonical ops into one piece");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPlanElementwise(const Problem& p, const Plan& plan, const CheckOptions& opt) {
  const auto& tensors = p.inventory.tensors;
  // written[worker][piece][element] = bucket of the write, -1 if none.
  std::vector<std::vector<std::vector<int32_t>>> written(p.workers.size());
  for (size_t w = 0; w < p.workers.size(); ++w) {
    if (p.workers[w].role != Role::kRollout) continue;
    for (const Piece& pc : p.workers[w].layout.pieces) {
      written[w].emplace_back(BoxVolume(pc.box), -1);
    }
  }
  // Trainer staging (rank0 gather): (worker, tensor) -> bucket per element of the full tensor.
  std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>> staging;
  // Network deliveries per (node, tensor) per element.
  std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>> net;
  std::map<std::pair<int32_t, int32_t>, int32_t> slot_of;
  // Per rollout piece: -1 no op yet, 0 canonical ops (receiver-side quantisation), 1 sender-quantised.
  std::map<std::pair<int32_t, int32_t>, int> sender_quantized;
  for (const Worker& w : p.workers) slot_of.emplace(std::make_pair(w.node, w.gpu), static_cast<int32_t>(slot_of.size()));

  for (size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const int32_t b = static_cast<int32_t>(bi);
    std::map<int32_t, int64_t> sent, recv;
    std::map<int32_t, int32_t> sent_ops, recv_ops;
    for (size_t oi = 0; oi < plan.buckets[bi].ops.size(); ++oi) {
      const TransferOp& op = plan.buckets[bi].ops[oi];
      const std::string where = absl::StrCat("bucket ", bi, " op ", oi, ": ");
      if (op.src_worker < 0 || op.src_worker >= static_cast<int32_t>(p.workers.size()) ||
          op.dst_worker < 0 || op.dst_worker >= static_cast<int32_t>(p.workers.size())) {
        return absl::InternalError(where + "worker out of range");
      }
      if (op.tensor < 0 || op.tensor >= static_cast<int32_t>(tensors.size())) {
        return absl::InternalError(where + "tensor out of range");
      }
      const TensorSpec& ts = tensors[op.tensor];
      if (!BoxInside(op.box, ts.shape) || (BoxEmpty(op.box) && !ts.shape.empty())) {
        return absl::InternalError(where + "box outside tensor " + ts.name);
      }
      const int64_t vol = BoxVolume(op.box);
      if (op.bytes != vol * DTypeSize(ts.dtype)) return absl::InternalError(where + "bytes mismatch");
      const Worker& sw = p.workers[op.src_worker];
      const Worker& dw = p.workers[op.dst_worker];
      const Route want = (sw.node == dw.node && sw.gpu == dw.gpu) ? Route::kSameGpu
                         : sw.node == dw.node                     ? Route::kIntraNode
                                                                  : Route::kInterNode;
      if (op.route != want) return absl::InternalError(where + "wrong route");

      // Source.
      if (op.src_piece < 0) {
        if (!opt.allow_staging || sw.role != Role::kTrainer) {
          return absl::InternalError(where + "source piece missing");
        }
        auto it = staging.find({op.src_worker, op.tensor});
        if (it == staging.end()) return absl::InternalError(where + "staging read before gather");
        bool ok = true;
        ForEachElement(FullBox(ts.shape), op.box, [&](int64_t e) { ok &= it->second[e] >= 0 && it->second[e] < b; });
        if (!ok) return absl::InternalError(where + "staging read of bytes not gathered earlier");
      } else {
        if (op.src_piece >= static_cast<int32_t>(sw.layout.pieces.size())) {
          return absl::InternalError(where + "source piece out of range");
        }
        const Piece& sp = sw.layout.pieces[op.src_piece];
        if (sp.tensor != op.tensor || !BoxContains(sp.box, op.box)) {
          return absl::InternalError(absl::StrCat(where, "source piece ", BoxToString(sp.box),
                                                  " does not hold ", BoxToString(op.box)));
        }
        if (sw.role == Role::kRollout) {
          bool ok = true;
          const auto& wr = written[op.src_worker][op.src_piece];
          ForEachElement(sp.box, op.box, [&](int64_t e) { ok &= wr[e] >= 0 && wr[e] < b; });
          if (!ok) return absl::InternalError(where + "relay reads bytes not delivered in an earlier bucket");
        }
      }
      // Destination.
      if (op.dst_piece < 0) {
        if (!opt.allow_staging || dw.role != Role::kTrainer) {
          return absl::InternalError(where + "destination piece missing");
        }
        auto& st = staging[{op.dst_worker, op.tensor}];
        if (st.empty()) st.assign(BoxVolume(FullBox(ts.shape)), -1);
        ForEachElement(FullBox(ts.shape), op.box, [&](int64_t e) { st[e] = b; });
      } else {
        if (dw.role != Role::kRollout || op.dst_piece >= static_cast<int32_t>(dw.layout.pieces.size())) {
          return absl::InternalError(where + "destination piece invalid");
        }
        const Piece& dp = dw.layout.pieces[op.dst_piece];
        if (dp.tensor != op.tensor || !BoxContains(dp.box, op.box)) {
          return absl::InternalError(absl::StrCat(where, "destination piece ", BoxToString(dp.box),
                                                  " does not contain ", BoxToString(op.box)));
        }
        bool twice = false;
        auto& wr = written[op.dst_worker][op.dst_piece];
        ForEachElement(dp.box, op.box, [&](int64_t e) {
          twice |= wr[e] >= 0;
          wr[e] = b;
        });
        if (twice) {
          return absl::InternalError(absl::StrCat(where, "element of ", ts.name, " ", BoxToString(op.box),
                                                  " written twice on ", dw.id));
        }
      }
      if (op.route == Route::kInterNode) {
        auto& nv = net[{dw.node, op.tensor}];
        if (nv.empty()) nv.assign(BoxVolume(FullBox(ts.shape)), 0);
        bool dup = false;
        ForEachElement(FullBox(ts.shape), op.box, [&](int64_t e) { dup |= ++nv[e] > 1; });
        if (dup && opt.require_no_redundancy) {
          return absl::InternalError(absl::StrCat(where, ts.name, " ", BoxToString(op.box),
                                                  " crosses the network twice into node ", dw.node));
        }
      }
      if (absl::Status st = CheckWireBytes(p, op, sender_quantized, where); !st.ok()) return st;
      const int32_t ss = slot_of[{sw.node, sw.gpu}], ds = slot_of[{dw.node, dw.gpu}];
      const int64_t wire = op.wire_bytes > 0 ? op.wire_bytes : op.bytes;
      sent[ss] += wire;
      recv[ds] += wire;
      ++sent_ops[ss];
      ++recv_ops[ds];
    }
    if (opt.check_budget) {
      for (const auto& [slot, bytes] : sent) {
        if (bytes > p.staging_budget_bytes && sent_ops[slot] > 1) {
          return absl::InternalError(absl::StrCat("bucket ", bi, ": slot ", slot, " sends ", bytes,
                                                  " > budget ", p.staging_budget_bytes));
        }
      }
      for (const auto& [slot, bytes] : recv) {
        if (bytes > p.staging_budget_bytes && recv_ops[slot] > 1) {
          return absl::InternalError(absl::StrCat("bucket ", bi, ": slot ", slot, " receives ", bytes,
                                                  " > budget ", p.staging_budget_bytes));
        }
      }
    }
  }
  for (size_t w = 0; w < p.workers.size(); ++w) {
    for (size_t i = 0; i < written[w].size(); ++i) {
      for (int32_t v : written[w][i]) {
        if (v < 0) {
          const Piece& pc = p.workers[w].layout.pieces[i];
          return absl::InternalError(absl::StrCat("incomplete: ", p.workers[w].id, " piece ", i, " of ",
                                                  tensors[pc.tensor].name, " ", BoxToString(pc.box),
                                                  " has unwritten elements"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace wb::planner

#include "planner/planner.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/cost_model.h"
#include "planner/fingerprint.h"
#include "planner/fragments.h"
#include "planner/sender_quant.h"
#include "base/status_macros.h"

namespace wb::planner {
namespace {

constexpr double kGB = 1e9;

class Builder {
 public:
  Builder(const Problem& p, const FragmentSet& fs, const ClusterIndex& ci, const SenderQuantization& sq,
          Strategy strategy, double lower_bound_s)
      : p_(p), fs_(fs), ci_(ci), sq_(sq), strategy_(strategy), loads_(ci.num_slots),
        send_ptr_(ci.num_slots, 0), recv_ptr_(ci.num_slots, 0), reserve_(ci.num_slots, 0) {
    budget_ = p.staging_budget_bytes;
    close_ = budget_ - budget_ / 10;
    threshold_ = lower_bound_s * p.topology.nic_GBps_per_gpu * kGB;
    piece_base_.resize(p.workers.size() + 1, 0);
    for (size_t w = 0; w < p.workers.size(); ++w) {
      piece_base_[w + 1] = piece_base_[w] + p.workers[w].layout.pieces.size();
    }
    covered_.assign(piece_base_.back(), 0);
    plan_.strategy = strategy;
    plan_.stats.lower_bound_s = lower_bound_s;
  }

  absl::StatusOr<Plan> Run() {
    if (strategy_ == Strategy::kWeightBridge) PrecomputeReserve();
    int32_t rank0 = -1;
    if (strategy_ == Strategy::kRank0Broadcast) {
      for (size_t w = 0; w < p_.workers.size() && rank0 < 0; ++w) {
        if (p_.workers[w].role == Role::kTrainer) rank0 = static_cast<int32_t>(w);
      }
    }
    for (size_t fi = 0; fi < fs_.fragments.size(); ++fi) {
      const Fragment& f = fs_.fragments[fi];
      cur_quantized_ = sq_.quantized[fi] != 0;
      cur_wire_ = sq_.wire_bytes[fi];
      inter_nodes_.clear();
      switch (strategy_) {
        case Strategy::kWeightBridge:
          PlanWeightBridge(f, fi);
          break;
        case Strategy::kRank0Broadcast:
          PlanRank0(f, rank0);
          break;
        case Strategy::kOwnerBroadcast:
          for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) Emit(f, fs_.refs[f.src_begin], fs_.refs[k], -1);
          break;
        case Strategy::kP2PNoDedup:
          for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
            Emit(f, NearestSource(f, fs_.refs[k]), fs_.refs[k], -1);
          }
          break;
      }
      std::sort(inter_nodes_.begin(), inter_nodes_.end());
      for (size_t i = 1; i < inter_nodes_.size(); ++i) {
        if (inter_nodes_[i] == inter_nodes_[i - 1]) redundant_ += f.bytes;
      }
    }
    return Finish();
  }

 private:
  struct Holder {
    PieceRef ref;
    int32_t bucket;
  };

  int32_t Slot(PieceRef r) const { return ci_.worker_slot[r.worker]; }
  int32_t Node(PieceRef r) const { return ci_.worker_node[r.worker]; }

  // Each byte that must leave its holders will be sent at least once by one of them: reserve that
  // share of every holder's NIC egress so early fragments cannot use it up for extra copies.
  void PrecomputeReserve() {
    for (size_t fi = 0; fi < fs_.fragments.size(); ++fi) {
      const Fragment& f = fs_.fragments[fi];
      if (!Leaves(f)) continue;
      const double share = static_cast<double>(sq_.wire_bytes[fi]) / (f.src_end - f.src_begin);
      for (uint32_t k = f.src_begin; k < f.src_end; ++k) reserve_[Slot(fs_.refs[k])] += share;
    }
  }

  bool HasSourceOnNode(const Fragment& f, int32_t node) const {
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      if (Node(fs_.refs[k]) == node) return true;
    }
    return false;
  }

  bool Leaves(const Fragment& f) const {
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
      if (!HasSourceOnNode(f, Node(fs_.refs[k]))) return true;
    }
    return false;
  }

  // The cheapest holder for one destination: same GPU, else least intra-loaded on the node, else
  // least NIC-loaded anywhere.
  PieceRef NearestSource(const Fragment& f, PieceRef dst) const {
    const int32_t slot = Slot(dst), node = Node(dst);
    PieceRef best{-1, -1};
    int64_t best_load = 0;
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const PieceRef s = fs_.refs[k];
      if (Slot(s) == slot) return s;
    }
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const PieceRef s = fs_.refs[k];
      if (Node(s) != node) continue;
      const int64_t load = loads_.intra_out[Slot(s)];
      if (best.worker < 0 || load < best_load) {
        best = s;
        best_load = load;
      }
    }
    if (best.worker >= 0) return best;
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const PieceRef s = fs_.refs[k];
      const int64_t load = loads_.nic_out[Slot(s)];
      if (best.worker < 0 || load < best_load) {
        best = s;
        best_load = load;
      }
    }
    return best;
  }

  void PlanWeightBridge(const Fragment& f, size_t fi) {
    const int64_t b = cur_wire_;  // what each op of it moves
    const bool leaves = Leaves(f);
    if (leaves) {
      const double share = static_cast<double>(b) / (f.src_end - f.src_begin);
      for (uint32_t k = f.src_begin; k < f.src_end; ++k) reserve_[Slot(fs_.refs[k])] -= share;
    }
    by_node_.clear();
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) by_node_.emplace_back(Node(fs_.refs[k]), k);
    std::sort(by_node_.begin(), by_node_.end());
    node_starts_.clear();
    for (size_t i = 0; i < by_node_.size(); ++i) {
      if (i == 0 || by_node_[i].first != by_node_[i - 1].first) node_starts_.push_back(i);
    }
    const size_t nn = node_starts_.size();
    node_starts_.push_back(by_node_.size());
    holders_.clear();
    // Rotating the first node spreads the trainer-fed role (and the relay egress) over nodes.
    const size_t first = fi % nn;
    for (size_t step = 0; step < nn; ++step) {
      const size_t ni = (first + step) % nn;
      const size_t m0 = node_starts_[ni], m1 = node_starts_[ni + 1];
      const int32_t node = by_node_[m0].first;
      if (HasSourceOnNode(f, node)) {
        for (size_t m = m0; m < m1; ++m) {
          const PieceRef d = fs_.refs[by_node_[m].second];
          holders_.push_back({d, Emit(f, NearestSource(f, d), d, -1)});
        }
        continue;
      }
      // Receiver: the needer on this node with the least NIC ingress.
      size_t rm = m0;
      for (size_t m = m0 + 1; m < m1; ++m) {
        if (loads_.nic_in[Slot(fs_.refs[by_node_[m].second])] <
            loads_.nic_in[Slot(fs_.refs[by_node_[rm].second])]) {
          rm = m;
        }
      }
      const PieceRef r = fs_.refs[by_node_[rm].second];
      // Sender: the trainer holder with the least projected egress ...
      PieceRef s{-1, -1};
      double s_load = 0;
      for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
        const int32_t slot = Slot(fs_.refs[k]);
        const double load = loads_.nic_out[slot] + reserve_[slot];
        if (s.worker < 0 || load < s_load) {
          s = fs_.refs[k];
          s_load = load;
        }
      }
      PieceRef sender = s;
      int32_t dep = -1;
      // ... unless that pushes it past the lower bound and a rollout GPU that already holds the
      // bytes has spare egress: then that one forwards them (cross-node relay).
      if (s_load + b > threshold_ && !holders_.empty()) {
        const Holder* h = nullptr;
        for (const Holder& c : holders_) {
          if (h == nullptr || loads_.nic_out[Slot(c.ref)] < loads_.nic_out[Slot(h->ref)] ||
              (loads_.nic_out[Slot(c.ref)] == loads_.nic_out[Slot(h->ref)] && c.bucket < h->bucket)) {
            h = &c;
          }
        }
        if (static_cast<double>(loads_.nic_out[Slot(h->ref)]) < s_load) {
          sender = h->ref;
          dep = h->bucket;
        }
      }
      const int32_t rb = Emit(f, sender, r, dep);
      holders_.push_back({r, rb});
      for (size_t m = m0; m < m1; ++m) {
        if (m == rm) continue;
        const PieceRef d = fs_.refs[by_node_[m].second];
        holders_.push_back({d, Emit(f, r, d, rb)});
      }
    }
  }

  void PlanRank0(const Fragment& f, int32_t rank0) {
    PieceRef from{rank0, -1};
    int32_t dep = -1;
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      if (fs_.refs[k].worker == rank0) from = fs_.refs[k];
    }
    if (from.piece < 0) {
      // Gather into trainer 0's staging (dst_piece = -1) from the least-loaded holder.
      PieceRef s{-1, -1};
      int64_t best = 0;
      for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
        const PieceRef c = fs_.refs[k];
        const int64_t load = RouteBetween(ci_, c.worker, rank0) == Route::kInterNode
                                 ? loads_.nic_out[Slot(c)]
                                 : loads_.intra_out[Slot(c)];
        if (s.worker < 0 || load < best) {
          s = c;
          best = load;
        }
      }
      dep = Emit(f, s, PieceRef{rank0, -1}, -1);
    }
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) Emit(f, from, fs_.refs[k], dep);
  }

  // Records one op; returns its bucket. Links and staging count the bytes it moves.
  int32_t Emit(const Fragment& f, PieceRef src, PieceRef dst, int32_t dep) {
    const Route route = RouteBetween(ci_, src.worker, dst.worker);
    const int32_t ss = Slot(src), ds = Slot(dst);
    // A gather into a trainer's staging (dst.piece < 0) stays canonical.
    const bool quantized = cur_quantized_ && dst.piece >= 0;
    const int64_t wire = quantized ? cur_wire_ : f.bytes;
    loads_.Add(route, ss, ds, wire);
    const int32_t b = Place(ss, ds, wire, dep);
    TransferOp op;
    op.src_worker = src.worker;
    op.dst_worker = dst.worker;
    op.src_piece = src.piece;
    op.dst_piece = dst.piece;
    op.tensor = f.tensor;
    op.box = f.box;
    op.bytes = f.bytes;
    op.route = route;
    op.sender_quantized = quantized;
    op.wire_bytes = wire;
    plan_.buckets[b].ops.push_back(std::move(op));
    if (route == Route::kInterNode) {
      inter_nodes_.push_back(Node(dst));
      plan_.stats.bytes_inter_node += f.bytes;
      plan_.stats.wire_bytes_inter_node += wire;
    } else {
      plan_.stats.bytes_intra_node += f.bytes;
    }
    plan_.stats.wire_bytes += wire;
    if (quantized) plan_.stats.sender_quantized_bytes += f.bytes;
    if (dst.piece >= 0) covered_[piece_base_[dst.worker] + dst.piece] += f.bytes;
    return b;
  }

  // First bucket after `dep` where the source slot's sends and the destination slot's receives
  // stay within the staging budget (an op larger than the budget takes an empty bucket).
  int32_t Place(int32_t src_slot, int32_t dst_slot, int64_t bytes, int32_t dep) {
    int32_t b = std::max({dep + 1, send_ptr_[src_slot], recv_ptr_[dst_slot]});
    while (true) {
      Ensure(b);
      const int64_t s = send_[b][src_slot], r = recv_[b][dst_slot];
      if ((s == 0 || s + bytes <= budget_) && (r == 0 || r + bytes <= budget_)) break;
      ++b;
    }
    send_[b][src_slot] += bytes;
    recv_[b][dst_slot] += bytes;
    const int32_t nb = static_cast<int32_t>(send_.size());
    while (send_ptr_[src_slot] < nb && send_[send_ptr_[src_slot]][src_slot] >= close_) ++send_ptr_[src_slot];
    while (recv_ptr_[dst_slot] < nb && recv_[recv_ptr_[dst_slot]][dst_slot] >= close_) ++recv_ptr_[dst_slot];
    return b;
  }

  void Ensure(int32_t b) {
    while (static_cast<int32_t>(send_.size()) <= b) {
      send_.emplace_back(ci_.num_slots, 0);
      recv_.emplace_back(ci_.num_slots, 0);
      plan_.buckets.emplace_back();
    }
  }

  absl::StatusOr<Plan> Finish() {
    bool complete = true;
    for (size_t w = 0; w < p_.workers.size() && complete; ++w) {
      const Worker& wk = p_.workers[w];
      if (wk.role != Role::kRollout) continue;
      for (size_t i = 0; i < wk.layout.pieces.size(); ++i) {
        const Piece& pc = wk.layout.pieces[i];
        const int64_t want = BoxVolume(pc.box) * DTypeSize(p_.inventory.tensors[pc.tensor].dtype);
        if (covered_[piece_base_[w] + i] != want) {
          complete = false;
          break;
        }
      }
    }
    PlanStats& st = plan_.stats;
    st.complete = complete;
    st.redundant_bytes = redundant_;
    for (const Bucket& b : plan_.buckets) st.num_ops += static_cast<int64_t>(b.ops.size());
    st.makespan_s = MakespanOf(loads_, ci_, p_.topology);
    plan_.fingerprint = Fingerprint(p_, plan_);
    return std::move(plan_);
  }

  const Problem& p_;
  const FragmentSet& fs_;
  const ClusterIndex& ci_;
  const SenderQuantization& sq_;
  const Strategy strategy_;
  bool cur_quantized_ = false;  // of the fragment being planned
  int64_t cur_wire_ = 0;
  LinkLoads loads_;
  int64_t budget_ = 0, close_ = 0;
  double threshold_ = 0;
  std::vector<std::vector<int64_t>> send_, recv_;  // [bucket][slot] bytes
  std::vector<int32_t> send_ptr_, recv_ptr_;       // first bucket not yet (nearly) full, per slot
  std::vector<double> reserve_;                    // per slot: egress still owed to first copies
  std::vector<size_t> piece_base_;
  std::vector<int64_t> covered_;                   // bytes written per destination piece
  std::vector<int32_t> inter_nodes_;
  std::vector<std::pair<int32_t, uint32_t>> by_node_;
  std::vector<size_t> node_starts_;
  std::vector<Holder> holders_;
  int64_t redundant_ = 0;
  Plan plan_;
};

}  // namespace

absl::StatusOr<Plan> MakePlanWithOptions(const Problem& problem, Strategy strategy,
                                         const PlanOptions& options) {
  const Topology& t = problem.topology;
  if (!(t.nic_GBps_per_gpu > 0) || !(t.intra_node_GBps > 0) || !(t.same_gpu_GBps > 0)) {
    return absl::InvalidArgumentError("topology bandwidths must be positive");
  }
  if (problem.staging_budget_bytes <= 0) {
    return absl::InvalidArgumentError("staging_budget_bytes must be positive");
  }
  for (const Worker& w : problem.workers) {
    if (w.node < 0 || w.gpu < 0) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", w.id, ": negative node or gpu"));
    }
  }
  const ClusterIndex ci = IndexCluster(problem);
  FragmentOptions fo;
  fo.max_fragment_bytes = options.max_fragment_bytes;
  if (fo.max_fragment_bytes == 0) {
    // Balance granularity: small against one link's share, never above a quarter of the budget.
    fo.auto_grain_slots = std::max(ci.num_slots, 1);
    fo.auto_grain_cap = std::max<int64_t>(problem.staging_budget_bytes / 4, 1);
  } else if (fo.max_fragment_bytes < 0) {
    fo.max_fragment_bytes = 0;
  }
  fo.align_splits_to_quant_blocks = options.sender_quantization;
  ASSIGN_OR_RETURN(FragmentSet fs, BuildFragments(problem, fo));
  const SenderQuantization sq = DecideSenderQuantization(problem, fs, options.sender_quantization);
  const double lb = LowerBoundOfFragments(problem, ci, fs, &sq.wire_bytes);
  Builder builder(problem, fs, ci, sq, strategy, lb);
  return builder.Run();
}

absl::StatusOr<Plan> MakePlan(const Problem& problem, Strategy strategy) {
  return MakePlanWithOptions(problem, strategy, PlanOptions{});
}

}  // namespace wb::planner

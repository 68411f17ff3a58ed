#include "planner/planner.h"

#include <algorithm>
#include <string>

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

// Segment tree over leaves 0..n-1 (n <= capacity) that keeps the best leaf of every range under
// `less`, a strict total order on leaves the caller defines from its current keys (with a unique
// tie-break, so the answer never depends on the tree's shape). Best leaf of a range and a leaf
// whose key changed: O(log capacity) each.
class BestOf {
 public:
  template <typename Less>
  void Build(int32_t n, int32_t capacity, const Less& less) {
    size_ = 1;
    while (size_ < capacity) size_ <<= 1;
    t_.assign(2 * static_cast<size_t>(size_), -1);
    n_ = n;
    for (int32_t i = 0; i < n; ++i) t_[size_ + i] = i;
    for (int32_t i = size_ - 1; i >= 1; --i) t_[i] = Pick(t_[2 * i], t_[2 * i + 1], less);
  }
  // Adds leaf n (n < capacity).
  template <typename Less>
  void Append(const Less& less) {
    t_[size_ + n_] = n_;
    Update(n_++, less);
  }
  template <typename Less>
  void Update(int32_t leaf, const Less& less) {
    for (int32_t i = (leaf + size_) >> 1; i >= 1; i >>= 1) t_[i] = Pick(t_[2 * i], t_[2 * i + 1], less);
  }
  // Best leaf of [lo, hi); -1 when empty.
  template <typename Less>
  int32_t Query(int32_t lo, int32_t hi, const Less& less) const {
    int32_t best = -1;
    for (lo += size_, hi += size_; lo < hi; lo >>= 1, hi >>= 1) {
      if (lo & 1) best = Pick(best, t_[lo++], less);
      if (hi & 1) best = Pick(best, t_[--hi], less);
    }
    return best;
  }
  int32_t Best() const { return n_ > 0 ? t_[1] : -1; }

 private:
  template <typename Less>
  static int32_t Pick(int32_t a, int32_t b, const Less& less) {
    if (a < 0) return b;
    if (b < 0) return a;
    return less(b, a) ? b : a;
  }
  int32_t size_ = 1, n_ = 0;
  std::vector<int32_t> t_;
};

class Builder {
 public:
  Builder(const Problem& p, const FragmentSet& fs, const ClusterIndex& ci, const SenderQuantization& sq,
          Strategy strategy, double lower_bound_s, CancelPoll* cancel)
      : p_(p), fs_(fs), ci_(ci), sq_(sq), strategy_(strategy), cancel_(cancel), loads_(ci.num_slots),
        send_ptr_(ci.num_slots, 0), recv_ptr_(ci.num_slots, 0), reserve_(ci.num_slots, 0) {
    budget_ = p.staging_budget_bytes;
    close_ = budget_ - budget_ / 10;
    threshold_ = lower_bound_s * p.topology.nic_GBps_per_gpu * kGB;
    piece_base_.resize(p.workers.size() + 1, 0);
    for (size_t w = 0; w < p.workers.size(); ++w) {
      piece_base_[w + 1] = piece_base_[w] + p.workers[w].layout.pieces.size();
    }
    covered_.assign(piece_base_.back(), 0);
    node_stamp_.assign(ci.node_slots.size(), 0);
    node_lo_.assign(ci.node_slots.size(), 0);
    node_hi_.assign(ci.node_slots.size(), 0);
    slot_stamp_.assign(ci.num_slots, 0);
    slot_leaf_.assign(ci.num_slots, -1);
    relay_stamp_.assign(ci.num_slots, 0);
    relay_leaf_.assign(ci.num_slots, -1);
    plan_.strategy = strategy;
    plan_.stats.lower_bound_s = lower_bound_s;
  }

  absl::StatusOr<Plan> Run() {
    if (strategy_ == Strategy::kWeightBridge) RETURN_IF_ERROR(PrecomputeReserve());
    int32_t rank0 = -1;
    if (strategy_ == Strategy::kRank0Broadcast) {
      for (size_t w = 0; w < p_.workers.size() && rank0 < 0; ++w) {
        if (p_.workers[w].role == Role::kTrainer) rank0 = static_cast<int32_t>(w);
      }
    }
    const size_t nf = fs_.fragments.size();
    for (size_t fi = 0; fi < nf; ++fi) {
      const Fragment& f = fs_.fragments[fi];
      // Ops: one per needer, plus a gather (rank0) or relays' lookups; each a few tree steps.
      if (!Tick(1 + kCancelUnitsPerOp * (f.dst_end - f.dst_begin + 1) + (f.src_end - f.src_begin))) {
        return cancel_->Stopped(absl::StrCat("building the ", StrategyName(strategy_), " ops: fragment ", fi, " of ", nf,
                                             ", ", ops_, " ops built"));
      }
      cur_quantized_ = sq_.quantized[fi] != 0;
      cur_wire_ = sq_.wire_bytes[fi];
      inter_nodes_.clear();
      BeginFragment(f);
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
    if (cancel_ != nullptr && !cancel_->Poll()) {
      return cancel_->Stopped(absl::StrCat("before the plan's stats and fingerprint: ", ops_, " ops built"));
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

  bool Tick(int64_t units) { return cancel_ == nullptr || cancel_->Tick(units); }

  // Each byte that must leave its holders will be sent at least once by one of them: reserve that
  // share of every holder's NIC egress so early fragments cannot use it up for extra copies.
  absl::Status PrecomputeReserve() {
    const size_t nf = fs_.fragments.size();
    for (size_t fi = 0; fi < nf; ++fi) {
      const Fragment& f = fs_.fragments[fi];
      if (!Tick(1 + (f.src_end - f.src_begin) + (f.dst_end - f.dst_begin))) {
        return cancel_->Stopped(absl::StrCat("reserving sender egress: fragment ", fi, " of ", nf));
      }
      BeginFragment(f);
      if (!Leaves(f)) continue;
      const double share = static_cast<double>(sq_.wire_bytes[fi]) / (f.src_end - f.src_begin);
      for (uint32_t k = f.src_begin; k < f.src_end; ++k) reserve_[Slot(fs_.refs[k])] += share;
    }
    return absl::OkStatus();
  }

  // ---- Per-fragment index of the holders (docs/planner.md "Plan builder cost") ----
  // Built once per fragment, so each lookup below costs O(1) or O(log holders) instead of a scan
  // of every holder: a fragment with H holders and N needers costs O((H + N) log(H + N)), not
  // O(H x N). Every lookup returns exactly what the scan of the holders in ref order did (least
  // load, the earliest ref on ties), so plans and fingerprints are unchanged.
  //  - node_stamp_[node] == epoch_: a holder is on the node (marked by BeginFragment);
  //  - leaves (EnsureLeaves): one per GPU slot holding the fragment, with the first holder ref on
  //    it (holders sharing a slot share its loads, so the first one is the one a scan picks),
  //    ordered by (node, first ref); a node's leaves are [node_lo_, node_hi_);
  //  - intra_tree_: least intra-node egress over a node's leaves (the local sender);
  //  - nic_tree_: least NIC egress (kP2PNoDedup) or projected egress, NIC egress + reserve
  //    (kWeightBridge's sender) over all leaves;
  //  - relay_tree_: kWeightBridge's cross-node relay candidates (holders_), one leaf per rollout
  //    slot with its best entry (earliest bucket, then earliest entry), least NIC egress first.
  // Emit updates the trees of the slot whose load it changed.
  void BeginFragment(const Fragment& f) {
    ++epoch_;
    leaves_built_ = intra_valid_ = nic_valid_ = relay_valid_ = false;
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) node_stamp_[Node(fs_.refs[k])] = epoch_;
  }

  bool HasSourceOnNode(int32_t node) const { return node_stamp_[node] == epoch_; }

  bool Leaves(const Fragment& f) const {
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
      if (!HasSourceOnNode(Node(fs_.refs[k]))) return true;
    }
    return false;
  }

  void EnsureLeaves(const Fragment& f) {
    if (leaves_built_) return;
    leaves_built_ = true;
    leaf_slot_.clear();
    leaf_first_.clear();
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const int32_t slot = Slot(fs_.refs[k]);
      if (slot_stamp_[slot] == epoch_) continue;
      slot_stamp_[slot] = epoch_;
      leaf_slot_.push_back(slot);
      leaf_first_.push_back(k);
    }
    const size_t n = leaf_slot_.size();
    auto node_of_leaf = [&](size_t i) { return ci_.slot_node[leaf_slot_[i]]; };
    bool sorted = true;
    for (size_t i = 1; i < n && sorted; ++i) sorted = node_of_leaf(i - 1) <= node_of_leaf(i);
    if (!sorted) {
      leaf_order_.resize(n);
      for (size_t i = 0; i < n; ++i) leaf_order_[i] = static_cast<uint32_t>(i);
      std::stable_sort(leaf_order_.begin(), leaf_order_.end(),
                       [&](uint32_t a, uint32_t b) { return node_of_leaf(a) < node_of_leaf(b); });
      std::vector<int32_t> slots(n);
      std::vector<uint32_t> firsts(n);
      for (size_t i = 0; i < n; ++i) {
        slots[i] = leaf_slot_[leaf_order_[i]];
        firsts[i] = leaf_first_[leaf_order_[i]];
      }
      leaf_slot_.swap(slots);
      leaf_first_.swap(firsts);
    }
    for (size_t i = 0; i < n; ++i) {
      slot_leaf_[leaf_slot_[i]] = static_cast<int32_t>(i);
      const int32_t node = ci_.slot_node[leaf_slot_[i]];
      if (i == 0 || node != node_of_leaf(i - 1)) node_lo_[node] = static_cast<uint32_t>(i);
      node_hi_[node] = static_cast<uint32_t>(i + 1);
    }
  }

  bool IntraLess(int32_t a, int32_t b) const {
    const int64_t la = loads_.intra_out[leaf_slot_[a]], lb = loads_.intra_out[leaf_slot_[b]];
    return la != lb ? la < lb : leaf_first_[a] < leaf_first_[b];
  }
  // The sender's key: NIC egress, plus the reserve for kWeightBridge (as a double, as it compares).
  bool NicLess(int32_t a, int32_t b) const {
    const int32_t sa = leaf_slot_[a], sb = leaf_slot_[b];
    if (strategy_ == Strategy::kWeightBridge) {
      const double la = loads_.nic_out[sa] + reserve_[sa], lb = loads_.nic_out[sb] + reserve_[sb];
      if (la != lb) return la < lb;
    } else if (loads_.nic_out[sa] != loads_.nic_out[sb]) {
      return loads_.nic_out[sa] < loads_.nic_out[sb];
    }
    return leaf_first_[a] < leaf_first_[b];
  }
  bool RelayLess(int32_t a, int32_t b) const {
    const int64_t la = loads_.nic_out[relay_slot_[a]], lb = loads_.nic_out[relay_slot_[b]];
    if (la != lb) return la < lb;
    const int32_t ba = holders_[relay_best_[a]].bucket, bb = holders_[relay_best_[b]].bucket;
    if (ba != bb) return ba < bb;
    return relay_best_[a] < relay_best_[b];
  }

  void EnsureIntraTree(const Fragment& f) {
    EnsureLeaves(f);
    if (intra_valid_) return;
    intra_valid_ = true;
    const int32_t n = static_cast<int32_t>(leaf_slot_.size());
    intra_tree_.Build(n, n, [this](int32_t a, int32_t b) { return IntraLess(a, b); });
  }
  void EnsureNicTree(const Fragment& f) {
    EnsureLeaves(f);
    if (nic_valid_) return;
    nic_valid_ = true;
    const int32_t n = static_cast<int32_t>(leaf_slot_.size());
    nic_tree_.Build(n, n, [this](int32_t a, int32_t b) { return NicLess(a, b); });
  }
  void EnsureRelayTree(const Fragment& f) {
    if (relay_valid_) return;
    relay_valid_ = true;
    relay_slot_.clear();
    relay_best_.clear();
    for (size_t i = 0; i < holders_.size(); ++i) NoteRelayCandidate(i, /*in_tree=*/false);
    relay_tree_.Build(static_cast<int32_t>(relay_slot_.size()), std::max<int32_t>(f.dst_end - f.dst_begin, 1),
                      [this](int32_t a, int32_t b) { return RelayLess(a, b); });
  }
  // Files holders_[i] under its slot's leaf (new leaf, or a better entry for the slot).
  void NoteRelayCandidate(size_t i, bool in_tree) {
    const int32_t slot = Slot(holders_[i].ref);
    auto less = [this](int32_t a, int32_t b) { return RelayLess(a, b); };
    if (relay_stamp_[slot] != epoch_) {
      relay_stamp_[slot] = epoch_;
      relay_leaf_[slot] = static_cast<int32_t>(relay_slot_.size());
      relay_slot_.push_back(slot);
      relay_best_.push_back(static_cast<uint32_t>(i));
      if (in_tree) relay_tree_.Append(less);
      return;
    }
    const int32_t leaf = relay_leaf_[slot];
    if (holders_[i].bucket < holders_[relay_best_[leaf]].bucket) {
      relay_best_[leaf] = static_cast<uint32_t>(i);
      if (in_tree) relay_tree_.Update(leaf, less);
    }
  }
  void AddHolder(PieceRef ref, int32_t bucket) {
    holders_.push_back({ref, bucket});
    if (relay_valid_) NoteRelayCandidate(holders_.size() - 1, /*in_tree=*/true);
  }

  // After an op from `slot` over `route`: the trees keyed by that link's load see the change.
  void OnLoadChanged(Route route, int32_t slot) {
    if (route == Route::kIntraNode) {
      if (intra_valid_ && slot_stamp_[slot] == epoch_) {
        intra_tree_.Update(slot_leaf_[slot], [this](int32_t a, int32_t b) { return IntraLess(a, b); });
      }
    } else if (route == Route::kInterNode) {
      if (nic_valid_ && slot_stamp_[slot] == epoch_) {
        nic_tree_.Update(slot_leaf_[slot], [this](int32_t a, int32_t b) { return NicLess(a, b); });
      }
      if (relay_valid_ && relay_stamp_[slot] == epoch_) {
        relay_tree_.Update(relay_leaf_[slot], [this](int32_t a, int32_t b) { return RelayLess(a, b); });
      }
    }
  }

  // The cheapest holder for one destination: same GPU, else least intra-loaded on the node, else
  // least NIC-loaded anywhere (ties: the earliest holder ref).
  PieceRef NearestSource(const Fragment& f, PieceRef dst) {
    EnsureLeaves(f);
    const int32_t slot = Slot(dst), node = Node(dst);
    if (slot_stamp_[slot] == epoch_) return fs_.refs[leaf_first_[slot_leaf_[slot]]];
    if (HasSourceOnNode(node)) {
      EnsureIntraTree(f);
      const int32_t leaf = intra_tree_.Query(static_cast<int32_t>(node_lo_[node]), static_cast<int32_t>(node_hi_[node]),
                                             [this](int32_t a, int32_t b) { return IntraLess(a, b); });
      return fs_.refs[leaf_first_[leaf]];
    }
    EnsureNicTree(f);
    return fs_.refs[leaf_first_[nic_tree_.Best()]];
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
      if (HasSourceOnNode(node)) {
        for (size_t m = m0; m < m1; ++m) {
          const PieceRef d = fs_.refs[by_node_[m].second];
          AddHolder(d, Emit(f, NearestSource(f, d), d, -1));
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
      // Sender: the trainer holder with the least projected egress (the earliest on ties) ...
      EnsureNicTree(f);
      const int32_t sl = nic_tree_.Best();
      const PieceRef s = fs_.refs[leaf_first_[sl]];
      const double s_load = loads_.nic_out[leaf_slot_[sl]] + reserve_[leaf_slot_[sl]];
      PieceRef sender = s;
      int32_t dep = -1;
      // ... unless that pushes it past the lower bound and a rollout GPU that already holds the
      // bytes has spare egress: then that one forwards them (cross-node relay).
      // (The holder with the least NIC egress, then the earliest bucket, then the earliest entry.)
      if (s_load + b > threshold_ && !holders_.empty()) {
        EnsureRelayTree(f);
        const Holder h = holders_[relay_best_[relay_tree_.Best()]];
        if (static_cast<double>(loads_.nic_out[Slot(h.ref)]) < s_load) {
          sender = h.ref;
          dep = h.bucket;
        }
      }
      const int32_t rb = Emit(f, sender, r, dep);
      AddHolder(r, rb);
      for (size_t m = m0; m < m1; ++m) {
        if (m == rm) continue;
        const PieceRef d = fs_.refs[by_node_[m].second];
        AddHolder(d, Emit(f, r, d, rb));
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
    OnLoadChanged(route, ss);
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
    ++ops_;
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
  CancelPoll* const cancel_;  // null: never stops
  int64_t ops_ = 0;           // ops emitted so far (for the cancel message)
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
  // Per-fragment holder index (BeginFragment): stamps equal to epoch_ are the current fragment's.
  uint64_t epoch_ = 0;
  bool leaves_built_ = false, intra_valid_ = false, nic_valid_ = false, relay_valid_ = false;
  std::vector<uint64_t> node_stamp_, slot_stamp_, relay_stamp_;
  std::vector<uint32_t> node_lo_, node_hi_;   // per node: its leaves
  std::vector<int32_t> slot_leaf_;            // per slot: its leaf
  std::vector<int32_t> leaf_slot_;            // per leaf: the slot
  std::vector<uint32_t> leaf_first_;          // per leaf: the first holder ref (index into fs_.refs)
  std::vector<uint32_t> leaf_order_;
  BestOf intra_tree_, nic_tree_, relay_tree_;
  std::vector<int32_t> relay_leaf_;           // per slot: its relay leaf
  std::vector<int32_t> relay_slot_;           // per relay leaf: the slot
  std::vector<uint32_t> relay_best_;          // per relay leaf: its best entry of holders_
  int64_t redundant_ = 0;
  Plan plan_;
};

// The ops `strategy` will emit for `fs`: one per needer per fragment, plus rank0_broadcast's
// gather into trainer 0 for each fragment it does not hold. RESOURCE_EXHAUSTED past `limit`,
// naming the model, the tensor that needs the most ops, the count and the limit.
absl::Status CheckPlanSize(const Problem& p, const FragmentSet& fs, Strategy strategy, int64_t limit,
                           int64_t pieces, bool default_limit) {
  int32_t rank0 = -1;
  if (strategy == Strategy::kRank0Broadcast) {
    for (size_t w = 0; w < p.workers.size() && rank0 < 0; ++w) {
      if (p.workers[w].role == Role::kTrainer) rank0 = static_cast<int32_t>(w);
    }
  }
  int64_t total = 0, tensor_ops = 0, most = 0, most_fragments = 0, fragments = 0;
  int32_t tensor = -1, most_tensor = -1;
  auto close_tensor = [&] {
    if (tensor >= 0 && tensor_ops > most) {
      most = tensor_ops;
      most_tensor = tensor;
      most_fragments = fragments;
    }
  };
  for (const Fragment& f : fs.fragments) {
    if (f.tensor != tensor) {
      close_tensor();
      tensor = f.tensor;
      tensor_ops = fragments = 0;
    }
    // Holders are in worker order and trainer 0 is the lowest-indexed trainer.
    const int64_t gather = rank0 >= 0 && (f.src_begin == f.src_end || fs.refs[f.src_begin].worker != rank0) ? 1 : 0;
    const int64_t n = int64_t{f.dst_end - f.dst_begin} + gather;
    tensor_ops += n;
    total += n;
    ++fragments;
  }
  close_tensor();
  if (total <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", p.inventory.architecture.empty() ? "(unnamed)" : p.inventory.architecture, ": the ",
      StrategyName(strategy), " plan would have ", total, " transfer ops, more than the limit of ", limit,
      default_limit ? absl::StrCat(" (", kPlanOpsBase, " + ", kPlanOpsPerPiece, " per piece, ", pieces, " pieces)")
                    : std::string(" (PlanOptions::max_ops)"),
      "; tensor ", p.inventory.tensors[most_tensor].name, " alone needs ", most, " ops in ", most_fragments,
      " fragments (docs/planner.md \"Work bounds\")"));
}

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
  CancelPoll poll(&options.cancel);
  if (!poll.Poll()) return poll.Stopped("before planning");
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
  fo.align_splits_to_quant_blocks = options.sender_quantization || options.quantized_sources;
  fo.cancel = &poll;
  ASSIGN_OR_RETURN(FragmentSet fs, BuildFragments(problem, fo));
  int64_t pieces = 0;
  for (const Worker& w : problem.workers) pieces += static_cast<int64_t>(w.layout.pieces.size());
  RETURN_IF_ERROR(CheckPlanSize(problem, fs, strategy, options.max_ops > 0 ? options.max_ops : MaxPlanOps(pieces),
                                pieces, options.max_ops <= 0));
  if (options.sender_quantization && options.quantized_sources) {
    return absl::InvalidArgumentError("sender_quantization and quantized_sources exclude each other (a catch-up quantises nothing on send)");
  }
  ASSIGN_OR_RETURN(const SenderQuantization sq,
                   DecideSenderQuantization(problem, fs, options.sender_quantization || options.quantized_sources, &poll,
                                            options.quantized_sources));
  if (options.quantized_sources) RETURN_IF_ERROR(KeepServingHolders(problem, sq, fs));
  const double lb = LowerBoundOfFragments(problem, ci, fs, &sq.wire_bytes);
  Builder builder(problem, fs, ci, sq, strategy, lb, &poll);
  return builder.Run();
}

absl::StatusOr<Plan> MakePlan(const Problem& problem, Strategy strategy) {
  return MakePlanWithOptions(problem, strategy, PlanOptions{});
}

}  // namespace wb::planner

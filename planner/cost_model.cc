#include "planner/cost_model.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "planner/sender_quant.h"

namespace wb::planner {
namespace {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr double kGB = 1e9;

}  // namespace

ClusterIndex IndexCluster(const Problem& problem) {
  ClusterIndex ci;
  std::vector<std::pair<int64_t, int32_t>> keys;  // ((node << 32) | gpu, worker)
  int32_t max_node = -1;
  for (size_t w = 0; w < problem.workers.size(); ++w) {
    const Worker& wk = problem.workers[w];
    keys.emplace_back((int64_t{wk.node} << 32) | static_cast<uint32_t>(wk.gpu), static_cast<int32_t>(w));
    max_node = std::max(max_node, wk.node);
  }
  std::sort(keys.begin(), keys.end());
  ci.worker_slot.assign(problem.workers.size(), -1);
  ci.worker_node.assign(problem.workers.size(), -1);
  ci.node_slots.assign(max_node + 1, 0);
  ci.node_has_rollout.assign(max_node + 1, 0);
  ci.node_has_trainer.assign(max_node + 1, 0);
  int64_t prev = -1;
  for (const auto& [key, w] : keys) {
    const Worker& wk = problem.workers[w];
    if (key != prev) {
      ci.slot_node.push_back(wk.node);
      ci.slot_gpu.push_back(wk.gpu);
      ++ci.node_slots[wk.node];
      prev = key;
    }
    ci.worker_slot[w] = static_cast<int32_t>(ci.slot_node.size()) - 1;
    ci.worker_node[w] = wk.node;
    if (wk.role == Role::kRollout) {
      ci.node_has_rollout[wk.node] = 1;
    } else {
      ci.node_has_trainer[wk.node] = 1;
    }
  }
  ci.num_slots = static_cast<int32_t>(ci.slot_node.size());
  return ci;
}

Route RouteBetween(const ClusterIndex& ci, int32_t src_worker, int32_t dst_worker) {
  if (ci.worker_slot[src_worker] == ci.worker_slot[dst_worker]) return Route::kSameGpu;
  if (ci.worker_node[src_worker] == ci.worker_node[dst_worker]) return Route::kIntraNode;
  return Route::kInterNode;
}

void LinkLoads::Add(Route route, int32_t src_slot, int32_t dst_slot, int64_t bytes) {
  switch (route) {
    case Route::kInterNode:
      nic_out[src_slot] += bytes;
      nic_in[dst_slot] += bytes;
      break;
    case Route::kIntraNode:
      intra_out[src_slot] += bytes;
      intra_in[dst_slot] += bytes;
      break;
    case Route::kSameGpu:
      same_gpu[dst_slot] += bytes;
      break;
  }
}

LinkLoads AccumulateLoads(const ClusterIndex& ci, const Plan& plan) {
  LinkLoads loads(ci.num_slots);
  for (const Bucket& b : plan.buckets) {
    for (const TransferOp& op : b.ops) {
      loads.Add(op.route, ci.worker_slot[op.src_worker], ci.worker_slot[op.dst_worker], OpWireBytes(op));
    }
  }
  return loads;
}

double MakespanOf(const LinkLoads& loads, const ClusterIndex& ci, const Topology& topo,
                  std::string* bottleneck) {
  double best = 0;
  const char* what = "";
  int32_t where = -1;
  auto consider = [&](const std::vector<int64_t>& v, double GBps, const char* name) {
    for (size_t s = 0; s < v.size(); ++s) {
      const double t = static_cast<double>(v[s]) / (GBps * kGB);
      if (t > best) {
        best = t;
        what = name;
        where = static_cast<int32_t>(s);
      }
    }
  };
  consider(loads.nic_out, topo.nic_GBps_per_gpu, "nic_egress");
  consider(loads.nic_in, topo.nic_GBps_per_gpu, "nic_ingress");
  consider(loads.intra_out, topo.intra_node_GBps, "intra_egress");
  consider(loads.intra_in, topo.intra_node_GBps, "intra_ingress");
  consider(loads.same_gpu, topo.same_gpu_GBps, "same_gpu");
  if (bottleneck != nullptr) {
    *bottleneck = where < 0 ? "none"
                            : absl::StrCat(what, " of node ", ci.slot_node[where], " gpu ",
                                           ci.slot_gpu[where]);
  }
  return best;
}

double PredictMakespan(const Problem& problem, const Plan& plan) {
  const ClusterIndex ci = IndexCluster(problem);
  return MakespanOf(AccumulateLoads(ci, plan), ci, problem.topology);
}

double LowerBoundOfFragments(const Problem& problem, const ClusterIndex& ci, const FragmentSet& fs,
                             const std::vector<int64_t>* wire_bytes) {
  const Topology& topo = problem.topology;
  const size_t num_nodes = ci.node_slots.size();
  std::vector<int64_t> node_in(num_nodes, 0), node_out(num_nodes, 0);
  // Per destination slot, distinct bytes it needs, by where the nearest holder is: another node
  // (off_node), another GPU of its node (on_node), its own GPU (own).
  std::vector<int64_t> excl_in(ci.num_slots, 0), on_node(ci.num_slots, 0), off_node(ci.num_slots, 0),
      own(ci.num_slots, 0);
  int64_t total_out = 0;
  struct SetLoad {
    int64_t bytes = 0;
    int32_t slots = 0;
  };
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, SetLoad> set_out;

  std::vector<int32_t> src_nodes, src_slots, dst_slots;
  for (size_t fi = 0; fi < fs.fragments.size(); ++fi) {
    const Fragment& f = fs.fragments[fi];
    const int64_t b = wire_bytes != nullptr ? (*wire_bytes)[fi] : f.bytes;
    src_nodes.clear();
    src_slots.clear();
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const int32_t w = fs.refs[k].worker;
      src_nodes.push_back(ci.worker_node[w]);
      src_slots.push_back(ci.worker_slot[w]);
    }
    std::sort(src_nodes.begin(), src_nodes.end());
    src_nodes.erase(std::unique(src_nodes.begin(), src_nodes.end()), src_nodes.end());
    std::sort(src_slots.begin(), src_slots.end());
    src_slots.erase(std::unique(src_slots.begin(), src_slots.end()), src_slots.end());
    auto has_src_node = [&](int32_t n) {
      return std::binary_search(src_nodes.begin(), src_nodes.end(), n);
    };

    // Destination slots (refs are in worker order, not node order).
    dst_slots.clear();
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) dst_slots.push_back(ci.worker_slot[fs.refs[k].worker]);
    // Distinct slots: two workers sharing a GPU may pass the bytes on with a same-GPU copy.
    std::sort(dst_slots.begin(), dst_slots.end());
    dst_slots.erase(std::unique(dst_slots.begin(), dst_slots.end()), dst_slots.end());
    // Slots are numbered in (node, gpu) order, so the sorted slots of one node are one run.
    bool leaves = false;
    for (size_t i = 0; i < dst_slots.size();) {
      const int32_t n = ci.slot_node[dst_slots[i]];
      size_t j = i + 1;
      while (j < dst_slots.size() && ci.slot_node[dst_slots[j]] == n) ++j;
      if (!has_src_node(n)) {
        leaves = true;
        node_in[n] += b;
        // Exclusive receiver: exactly one slot of this node needs the fragment.
        if (j - i == 1) excl_in[dst_slots[i]] += b;
      }
      i = j;
    }
    for (int32_t slot : dst_slots) {
      if (std::binary_search(src_slots.begin(), src_slots.end(), slot)) {
        own[slot] += b;
      } else if (has_src_node(ci.slot_node[slot])) {
        on_node[slot] += b;
      } else {
        off_node[slot] += b;
      }
    }
    if (!leaves) continue;
    total_out += b;
    if (src_nodes.size() == 1) node_out[src_nodes[0]] += b;
    bool rollout_near = false;
    for (int32_t n : src_nodes) rollout_near |= ci.node_has_rollout[n] != 0;
    if (!rollout_near) {
      uint64_t ha = 0, hb = 0;
      for (int32_t s : src_slots) {
        ha += Mix(static_cast<uint64_t>(s) + 1);
        hb += Mix((static_cast<uint64_t>(s) + 1) ^ 0xabcdef1234567ULL);
      }
      SetLoad& sl = set_out[{ha, hb}];
      sl.bytes += b;
      sl.slots = static_cast<int32_t>(src_slots.size());
    }
  }

  const double nic = topo.nic_GBps_per_gpu * kGB, intra = topo.intra_node_GBps * kGB,
               same = topo.same_gpu_GBps * kGB;
  double lb = 0;
  int64_t source_node_slots = 0;
  for (size_t n = 0; n < num_nodes; ++n) {
    if (ci.node_slots[n] == 0) continue;
    lb = std::max(lb, node_in[n] / (ci.node_slots[n] * nic));
    lb = std::max(lb, node_out[n] / (ci.node_slots[n] * nic));
    if (ci.node_has_trainer[n]) source_node_slots += ci.node_slots[n];
  }
  for (int32_t s = 0; s < ci.num_slots; ++s) {
    lb = std::max(lb, excl_in[s] / nic);
    lb = std::max(lb, on_node[s] / intra);
    // Every byte a slot needs and does not hold enters it over its NIC or its intra-node link
    // (a same-GPU copy needs a holder on that GPU); every byte it needs at all over one of the
    // three. Their bytes / (summed bandwidth) bound the busier of those links.
    lb = std::max(lb, static_cast<double>(on_node[s] + off_node[s]) / (nic + intra));
    lb = std::max(lb, static_cast<double>(on_node[s] + off_node[s] + own[s]) / (nic + intra + same));
  }
  for (const auto& [key, sl] : set_out) lb = std::max(lb, sl.bytes / (sl.slots * nic));
  if (source_node_slots > 0) lb = std::max(lb, total_out / (source_node_slots * nic));
  return lb;
}

double LowerBound(const Problem& problem, bool sender_quantization) {
  auto fs = BuildFragments(problem, FragmentOptions{});
  if (!fs.ok()) return -1;
  if (!sender_quantization) return LowerBoundOfFragments(problem, IndexCluster(problem), *fs);
  // Unsplit fragments: a fragment's aligned splits (MakePlan's) are quantised exactly when it is,
  // and their wire bytes add up to its own.
  const SenderQuantization sq = DecideSenderQuantization(problem, *fs, true);
  return LowerBoundOfFragments(problem, IndexCluster(problem), *fs, &sq.wire_bytes);
}

}  // namespace wb::planner

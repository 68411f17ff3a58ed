#include "daemon/limits.h"

#include <algorithm>
#include <climits>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

absl::Status CheckId(const std::string& what, const std::string& id, const Limits& limits) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (static_cast<int64_t>(id.size()) > limits.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", id.size(), " bytes, more than the limit of ", limits.max_name_bytes));
  }
  for (unsigned char c : id) {
    if (c < 0x20 || c == 0x7f) return absl::InvalidArgumentError(absl::StrCat(what, " contains a control character"));
  }
  return absl::OkStatus();
}

std::string BoundNodeText(std::string text) {
  if (text.size() <= kMaxNodeTextBytes) return text;
  const size_t full = text.size();
  size_t cut = kMaxNodeTextBytes;
  // Back off continuation bytes (10xxxxxx) so that the cut never splits a UTF-8 character.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  text.resize(cut);
  absl::StrAppend(&text, "... (truncated: ", full, " bytes)");
  return text;
}

int64_t PeerMessageBytes(const Limits& limits) {
  // One TensorSpec at worst: name (tag + 2-byte length + bytes), packed shape (tag + length + 10
  // bytes per varint), dtype (2), and its own tag + length (4). Twice per tensor, plus 1 MiB.
  const int64_t per_tensor = 2 * ((3 + int64_t{limits.max_name_bytes}) + (3 + 10 * int64_t{limits.max_dims}) + 2 + 4);
  const int64_t inventory = per_tensor * limits.max_tensors_per_model + (int64_t{1} << 20);
  return std::min<int64_t>(std::max(limits.max_message_bytes, inventory), INT32_MAX);
}

int ServerThreadBudget(const Limits& limits) { return limits.max_blocked_calls + std::max(1, limits.server_thread_headroom); }

int BlockedCallsPerNode(const Limits& limits, int total) {
  const int share = limits.max_blocked_calls_per_node > 0 ? limits.max_blocked_calls_per_node : std::max(16, total / 4);
  return std::min(share, total);
}

absl::Status CheckModelSpec(const pb::ModelSpec& spec, const Limits& limits) {
  if (!spec.model_id().empty()) {
    if (absl::Status s = CheckId("model_id", spec.model_id(), limits); !s.ok()) return s;
  }
  if (spec.num_trainer_workers() > 1u << 20 || spec.num_rollout_workers() > 1u << 20) {
    return absl::ResourceExhaustedError(absl::StrCat("model ", spec.model_id(), ": more than ", 1 << 20, " workers of one role"));
  }
  if (!spec.has_explicit_tensors()) return absl::OkStatus();
  const auto& tensors = spec.explicit_tensors().tensors();
  if (tensors.size() > limits.max_tensors_per_model) {
    return absl::ResourceExhaustedError(absl::StrCat("model ", spec.model_id(), " has ", tensors.size(),
                                                     " tensors, more than the limit of ", limits.max_tensors_per_model));
  }
  std::set<std::string> names;
  for (const pb::TensorSpec& t : tensors) {
    if (absl::Status s = CheckId("tensor name", t.name(), limits); !s.ok()) return s;
    if (!names.insert(t.name()).second) return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), " appears twice"));
    if (t.shape().empty() || t.shape_size() > limits.max_dims) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), " has rank ", t.shape_size(), " (must be 1..", limits.max_dims, ")"));
    }
    int64_t elements = 1;
    for (int64_t d : t.shape()) {
      if (d <= 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), " has a dimension of ", d));
      if (__builtin_mul_overflow(elements, d, &elements) || elements > limits.max_tensor_elements) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), ": element count overflows or exceeds ",
                                                       limits.max_tensor_elements));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLayoutRequest(const google::protobuf::RepeatedPtrField<pb::BufferSpec>& buffers,
                                const pb::LayoutSpec& layout, const Limits& limits) {
  if (buffers.size() > limits.max_buffers_per_worker) {
    return absl::ResourceExhaustedError(absl::StrCat(buffers.size(), " buffers, more than the limit of ", limits.max_buffers_per_worker,
                                                     " per worker"));
  }
  std::set<uint32_t> ids;
  int64_t total = 0;
  for (const pb::BufferSpec& b : buffers) {
    if (!ids.insert(b.buffer_id()).second) return absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), " appears twice"));
    if (b.size_bytes() == 0) return absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), " has size 0"));
    if (b.cuda_vmm_next_keys_size() > 0 && b.memory_case() != pb::BufferSpec::kCudaVmmKey) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": cuda_vmm_next_keys without cuda_vmm_key"));
    }
    if (b.size_bytes() > static_cast<uint64_t>(limits.max_buffer_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat("buffer ", b.buffer_id(), " is ", b.size_bytes(), " bytes, more than the limit of ",
                                                       limits.max_buffer_bytes));
    }
    const bool cuda = b.memory_case() == pb::BufferSpec::kCudaIpcHandle || b.memory_case() == pb::BufferSpec::kCudaVmmKey;
    if (limits.cuda_staged_on_gpu && cuda) continue;
    total += static_cast<int64_t>(b.size_bytes());  // <= 1024 * 2^40: no overflow
    if (total > limits.max_worker_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("buffers of one worker exceed ", limits.max_worker_bytes,
                                                       " bytes (the node's staging budget)"));
    }
  }
  if (layout.has_pieces()) {
    const auto& pieces = layout.pieces().pieces();
    if (pieces.size() > limits.max_pieces_per_layout) {
      return absl::ResourceExhaustedError(absl::StrCat("layout has ", pieces.size(), " pieces, more than the limit of ",
                                                       limits.max_pieces_per_layout));
    }
    for (const pb::Piece& p : pieces) {
      const std::string what = absl::StrCat("piece of tensor ", p.tensor());
      if (p.box().begin_size() != p.box().end_size() || p.box().begin_size() == 0 || p.box().begin_size() > limits.max_dims) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": box has begin rank ", p.box().begin_size(), " and end rank ",
                                                       p.box().end_size(), " (must match, 1..", limits.max_dims, ")"));
      }
      if (!p.strides().empty() && p.strides_size() != p.box().begin_size()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": ", p.strides_size(), " strides for a rank-", p.box().begin_size(), " box"));
      }
      int64_t elements = 1;
      for (int i = 0; i < p.box().begin_size(); ++i) {
        const int64_t b = p.box().begin(i), e = p.box().end(i);
        if (b < 0 || e <= b) return absl::InvalidArgumentError(absl::StrCat(what, ": dim ", i, " range [", b, ",", e, ") is empty or negative"));
        if (__builtin_mul_overflow(elements, e - b, &elements) || elements > limits.max_tensor_elements) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": box element count overflows"));
        }
      }
      for (int64_t s : p.strides()) {
        if (s < 0 || s > limits.max_tensor_elements) return absl::InvalidArgumentError(absl::StrCat(what, ": stride ", s, " out of range"));
      }
      if (!ids.count(p.buffer_id())) return absl::InvalidArgumentError(absl::StrCat(what, ": unknown buffer ", p.buffer_id()));
      if (p.offset_bytes() > static_cast<uint64_t>(limits.max_buffer_bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", p.offset_bytes(), " out of range"));
      }
    }
  } else if (layout.has_index_probe()) {
    if (layout.index_probe().tensors_size() > limits.max_pieces_per_layout) {
      return absl::ResourceExhaustedError(absl::StrCat("index probe has ", layout.index_probe().tensors_size(),
                                                       " tensors, more than the limit of ", limits.max_pieces_per_layout));
    }
    for (const auto& t : layout.index_probe().tensors()) {
      if (t.shape_size() > limits.max_dims) return absl::InvalidArgumentError("index probe tensor rank too large");
      int64_t elements = 1;
      for (int64_t d : t.shape()) {
        if (d <= 0 || __builtin_mul_overflow(elements, d, &elements) || elements > limits.max_tensor_elements) {
          return absl::InvalidArgumentError("index probe tensor shape is empty or overflows");
        }
      }
    }
  }
  return absl::OkStatus();
}

namespace {

constexpr uint64_t kSaturated = uint64_t{1} << 62;
// Box pairs compared while looking for overlapping ops inside one slice's destination pieces. Real
// slices tile each piece along one dimension, and the sweep below runs along the dimension with
// the most distinct starts, so it compares each op with about one other; this bounds what a
// hostile slice (many ops overlapping each other in every dimension) can make a node spend.
constexpr int64_t kOverlapComparisons = int64_t{1} << 27;

// An op's box clipped to its destination piece (half-open per dimension).
struct Clipped {
  std::vector<int64_t> begin, end;
  int op = 0;  // index in the slice, for messages
};

// `a` clipped to `b`; nullopt when they do not intersect or differ in rank.
std::optional<Clipped> Clip(const pb::Box& a, const pb::Box& b, int op) {
  if (a.begin_size() != a.end_size() || b.begin_size() != b.end_size() || a.begin_size() != b.begin_size()) return std::nullopt;
  Clipped c;
  c.op = op;
  for (int d = 0; d < a.begin_size(); ++d) {
    const int64_t lo = std::max(a.begin(d), b.begin(d)), hi = std::min(a.end(d), b.end(d));
    if (hi <= lo) return std::nullopt;
    c.begin.push_back(lo);
    c.end.push_back(hi);
  }
  return c;
}

uint64_t Elements(const std::vector<int64_t>& begin, const std::vector<int64_t>& end) {
  uint64_t n = 1;
  for (size_t d = 0; d < begin.size(); ++d) {
    const uint64_t len = static_cast<uint64_t>(end[d]) - static_cast<uint64_t>(begin[d]);
    n = len != 0 && n > kSaturated / len ? kSaturated : n * len;
  }
  return n;
}

bool Overlap(const Clipped& a, const Clipped& b) {
  for (size_t d = 0; d < a.begin.size(); ++d) {
    if (std::max(a.begin[d], b.begin[d]) >= std::min(a.end[d], b.end[d])) return false;
  }
  return true;
}

// Two boxes of `boxes` (all clipped to one piece) that overlap, or nullopt; sweeps along the
// dimension where the boxes start at the most distinct places. RESOURCE_EXHAUSTED past `*budget`
// comparisons (shared by the whole slice).
absl::StatusOr<std::optional<std::pair<int, int>>> FindOverlap(std::vector<Clipped>& boxes, int64_t* budget) {
  if (boxes.size() < 2) return std::optional<std::pair<int, int>>();
  const size_t rank = boxes[0].begin.size();
  size_t dim = 0, best = 0;
  for (size_t d = 0; d < rank; ++d) {
    std::vector<int64_t> starts;
    starts.reserve(boxes.size());
    for (const Clipped& b : boxes) starts.push_back(b.begin[d]);
    std::sort(starts.begin(), starts.end());
    const size_t distinct = static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
    if (distinct > best) best = distinct, dim = d;
  }
  std::sort(boxes.begin(), boxes.end(), [dim](const Clipped& a, const Clipped& b) { return a.begin[dim] < b.begin[dim]; });
  std::vector<const Clipped*> active;  // boxes whose extent along `dim` reaches the current start
  for (const Clipped& b : boxes) {
    active.erase(std::remove_if(active.begin(), active.end(), [&](const Clipped* a) { return a->end[dim] <= b.begin[dim]; }),
                 active.end());
    for (const Clipped* a : active) {
      if (--*budget < 0) {
        return absl::ResourceExhaustedError(absl::StrCat("the slice's ops need more than ", kOverlapComparisons,
                                                         " box comparisons to check that they do not overlap"));
      }
      if (Overlap(*a, b)) return std::optional<std::pair<int, int>>(std::make_pair(a->op, b.op));
    }
    active.push_back(&b);
  }
  return std::optional<std::pair<int, int>>();
}

std::string Cut(const std::string& v) { return v.size() > 64 ? v.substr(0, 64) + "..." : v; }

}  // namespace

absl::Status CheckSliceCoversLocalRollouts(const pb::PlanSlice& slice, const std::string& node_id) {
  const int workers = slice.workers_size();
  // (worker, piece) -> the ops' boxes landing there, clipped to the piece.
  std::map<std::pair<int, int>, std::vector<Clipped>> landed;
  // A version's slice writes every rollout of the node (one it leaves out would apply staging
  // nobody wrote); a catch-up slice only the late rollouts it writes into.
  std::set<int> destinations;
  for (int w = 0; w < workers && !slice.catch_up(); ++w) {
    if (slice.workers(w).node_id() == node_id && slice.workers(w).role() == pb::ROLE_ROLLOUT) destinations.insert(w);
  }
  for (int i = 0; i < slice.ops_size(); ++i) {
    const pb::TransferOp& op = slice.ops(i);
    const int w = static_cast<int>(op.dst_worker());
    if (op.dst_worker() >= static_cast<uint32_t>(workers) || op.dst_piece() < 0) continue;  // staging, or refused by InstallPlan
    const pb::PlanWorker& pw = slice.workers(w);
    if (pw.node_id() != node_id || pw.role() != pb::ROLE_ROLLOUT || op.dst_piece() >= pw.layout().pieces_size()) continue;
    destinations.insert(w);
    std::vector<Clipped>& boxes = landed[{w, op.dst_piece()}];
    if (std::optional<Clipped> c = Clip(op.box(), pw.layout().pieces(op.dst_piece()).box(), i)) boxes.push_back(*std::move(c));
  }
  auto prefix = [&](const pb::PlanWorker& pw, int p) {
    return absl::StrCat("plan epoch ", slice.plan_epoch(), " of model ", Cut(slice.model_id()), " on node ", Cut(node_id), ": rollout ",
                        Cut(pw.worker_id()), " piece ", p, " (tensor ", Cut(pw.layout().pieces(p).tensor()), ")");
  };
  int64_t budget = kOverlapComparisons;
  for (int w : destinations) {
    const pb::PlanWorker& pw = slice.workers(w);
    for (int p = 0; p < pw.layout().pieces_size(); ++p) {
      const pb::Box& box = pw.layout().pieces(p).box();
      std::vector<int64_t> begin(box.begin().begin(), box.begin().end()), end(box.end().begin(), box.end().end());
      const uint64_t need = begin.size() == end.size() ? Elements(begin, end) : 0;
      auto it = landed.find({w, p});
      uint64_t got = 0;
      if (it != landed.end()) {
        // The planner writes every destination element once; ops that overlap would let their
        // sum reach the piece's size while leaving part of it unwritten.
        using Pair = std::optional<std::pair<int, int>>;
        ASSIGN_OR_RETURN(Pair both, FindOverlap(it->second, &budget));
        if (both.has_value()) {
          return absl::InvalidArgumentError(absl::StrCat(prefix(pw, p), ": ops ", both->first, " and ", both->second,
                                                         " of the slice write the same elements; a plan writes each element once"));
        }
        for (const Clipped& c : it->second) got = std::min(kSaturated, got + Elements(c.begin, c.end));
      }
      if (got >= need) continue;
      return absl::InvalidArgumentError(absl::StrCat(prefix(pw, p), " gets ", got, " of its ", need,
                                                     " elements from the slice's ops; a version committed from it would leave the "
                                                     "rollout's live weights part old, part new"));
    }
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon

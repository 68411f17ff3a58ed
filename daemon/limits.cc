#include "daemon/limits.h"

#include <algorithm>
#include <climits>
#include <set>

#include "absl/strings/str_cat.h"

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

int64_t PeerMessageBytes(const Limits& limits) {
  // One TensorSpec at worst: name (tag + 2-byte length + bytes), packed shape (tag + length + 10
  // bytes per varint), dtype (2), and its own tag + length (4). Twice per tensor, plus 1 MiB.
  const int64_t per_tensor = 2 * ((3 + int64_t{limits.max_name_bytes}) + (3 + 10 * int64_t{limits.max_dims}) + 2 + 4);
  const int64_t inventory = per_tensor * limits.max_tensors_per_model + (int64_t{1} << 20);
  return std::min<int64_t>(std::max(limits.max_message_bytes, inventory), INT32_MAX);
}

int ServerThreadBudget(const Limits& limits) { return limits.max_blocked_calls + 256; }

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

}  // namespace wb::daemon

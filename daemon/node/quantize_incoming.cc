#include "daemon/node/quantize_incoming.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "daemon/box_copy.h"
#include "daemon/digest/digest.h"
#include "daemon/node/exec_plan.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/sender_quant.h"

namespace wb::daemon::node {

struct IncomingQuantization::Job {
  const planner::Piece* live;    // the quantised piece (its place and scales in staging)
  const planner::Piece* shadow;  // where its canonical bytes landed
  StagedBuffer* elements;
  StagedBuffer* scales;
  int group = -1;                // NVFP4: index into groups_ (the pieces sharing its global scale)
  size_t target = 0;             // where it comes from (after_piece)
  int32_t piece = 0;
};

// NVFP4 global scales: the pieces naming one (rollout, scale buffer, offset) slot share it, and
// slots whose pieces hold parts of one canonical tensor are merged (transitively): the group's
// scale is the largest magnitude over all their pieces, written into every slot - ModelOpt's one
// weight_scale_2 per full tensor (unified over a fused layer's tensors), which every TP rank of
// the engine holds, when this node holds the whole tensors.
struct IncomingQuantization::Group {
  std::vector<std::pair<StagedBuffer*, int64_t>> slots;  // where the global scale goes
  std::vector<size_t> jobs;
  bool partial = false;  // the pieces do not cover their canonical tensors: a partial magnitude
  size_t ready = 0;      // jobs whose ops all landed (under mu_)
  size_t amax_left = 0;  // magnitude tasks not done yet (under mu_)
  float amax = 0.0f;     // (under mu_)
  float global = 0.0f;   // written once before the group's quantise tasks are queued
};

namespace {

// The larger magnitude; a NaN sticks (an element that is NaN makes the group's scale NaN).
float MaxMagnitude(float a, float b) { return (std::isnan(b) || b > a) ? b : a; }

}  // namespace

IncomingQuantization::IncomingQuantization(const planner::Inventory& inventory, uint64_t version, absl::Time deadline)
    : inventory_(inventory), version_(version), deadline_(deadline) {}

absl::Status IncomingQuantization::DeadlineError() const {
  return absl::DeadlineExceededError(absl::StrCat("version ", version_, ": quantising did not finish before the transfer deadline"));
}

void IncomingQuantization::MergeGroups(const std::vector<std::pair<StagedBuffer*, int64_t>>& slots) {
  // Union-find over the slots: two slots whose pieces share a canonical tensor are one group.
  std::vector<size_t> parent(slots.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  auto root = [&parent](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::map<int32_t, size_t> slot_of_tensor;
  for (const Job& job : jobs_) {
    if (job.group < 0) continue;
    auto [it, added] = slot_of_tensor.try_emplace(job.live->tensor, static_cast<size_t>(job.group));
    if (!added) parent[root(static_cast<size_t>(job.group))] = root(it->second);
  }
  std::map<size_t, size_t> group_of_root;
  for (size_t i = 0; i < slots.size(); ++i) {
    auto [it, added] = group_of_root.try_emplace(root(i), groups_.size());
    if (added) groups_.emplace_back();
    groups_[it->second].slots.push_back(slots[i]);
  }
  std::vector<std::map<int32_t, std::vector<planner::Box>>> boxes(groups_.size());  // group -> tensor -> boxes
  for (size_t j = 0; j < jobs_.size(); ++j) {
    Job& job = jobs_[j];
    if (job.group < 0) continue;
    job.group = static_cast<int>(group_of_root.at(root(static_cast<size_t>(job.group))));
    groups_[static_cast<size_t>(job.group)].jobs.push_back(j);
    boxes[static_cast<size_t>(job.group)][job.live->tensor].push_back(job.live->box);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (const auto& [tensor, b] : boxes[g]) {
      if (!planner::BoxesCover(b, inventory_.tensors[static_cast<size_t>(tensor)].shape)) groups_[g].partial = true;
    }
    base_.partial_global_scales += groups_[g].partial ? 1 : 0;
  }
  base_.global_scales = static_cast<int64_t>(groups_.size());
}

absl::StatusOr<std::unique_ptr<IncomingQuantization>> IncomingQuantization::Start(const planner::Inventory& inventory,
                                                                                  std::vector<QuantizeTarget> targets, uint64_t version,
                                                                                  absl::Time deadline, const IncomingOptions& options) {
  std::unique_ptr<IncomingQuantization> q(new IncomingQuantization(inventory, version, deadline));
  q->targets_ = std::move(targets);
  std::vector<std::vector<uint32_t>> ops_of_job;
  std::map<std::pair<StagedBuffer*, int64_t>, size_t> slot_index;  // NVFP4 global scale slot -> index
  std::vector<std::pair<StagedBuffer*, int64_t>> slots;
  for (QuantizeTarget& t : q->targets_) {
    StagedBytes& staging = *t.staging;
    for (size_t k = 0; k < t.live->pieces.size(); ++k) {
      const planner::Piece& p = t.live->pieces[k];
      if (!p.quant.has_value()) continue;
      if (t.sender_quantized != nullptr && t.sender_quantized->count(static_cast<int32_t>(k)) > 0) continue;
      const size_t b = static_cast<size_t>(p.buffer), sb = static_cast<size_t>(p.quant->scale_buffer);
      if (b >= staging.size() || sb >= staging.size() || staging[b].device != nullptr || staging[sb].device != nullptr ||
          k >= t.shadow->pieces.size()) {
        return absl::InternalError(absl::StrCat("version ", version, ": staging of rollout ", t.worker,
                                                " cannot be quantised (buffer missing or not in host memory)"));
      }
      // The layout was validated (coordinator) and StagingLayout grew the buffers; check anyway
      // that every byte the quantiser touches lies in staging.
      const int64_t sh_bytes = planner::BoxVolume(p.box) * planner::DTypeSize(inventory.tensors[p.tensor].dtype);
      const planner::Piece& sp = t.shadow->pieces[k];
      if (sp.offset_bytes + sh_bytes > staging[b].size() ||
          p.quant->scale_offset_bytes + planner::ScaleCount(p) * planner::ScaleElementSize(*p.quant) > staging[sb].size()) {
        return absl::InternalError(absl::StrCat("version ", version, ": rollout ", t.worker, " tensor ", inventory.tensors[p.tensor].name,
                                                ": quantised piece outside its staging"));
      }
      const planner::ByteView bytes_of_p = planner::StoredBytes(inventory, p);  // int4: two elements per byte
      RETURN_IF_ERROR(CheckPieceInBuffer(bytes_of_p.piece, bytes_of_p.element_size, staging[b].size(), inventory.tensors[p.tensor].name));
      Job job{&p, &sp, &staging[b], &staging[sb], -1, static_cast<size_t>(&t - q->targets_.data()), static_cast<int32_t>(k)};
      if (p.quant->global_scale_offset_bytes >= 0) {
        const int64_t g = p.quant->global_scale_offset_bytes;
        if (g + 4 > static_cast<int64_t>(staging[sb].size())) {
          return absl::InternalError(absl::StrCat("version ", version, ": rollout ", t.worker, " tensor ", inventory.tensors[p.tensor].name,
                                                  ": global scale outside its staging"));
        }
        auto [it, added] = slot_index.try_emplace({&staging[sb], g}, slots.size());
        if (added) slots.push_back(it->first);
        job.group = static_cast<int>(it->second);  // the slot for now; MergeGroups makes it the group
      }
      auto l = t.landing.find(static_cast<int32_t>(k));
      ops_of_job.push_back(l == t.landing.end() ? std::vector<uint32_t>{} : l->second);
      q->jobs_.push_back(job);
      q->base_.bytes += sh_bytes;
    }
  }
  q->MergeGroups(slots);
  q->base_.pieces = static_cast<int64_t>(q->jobs_.size());
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::min<int>(static_cast<int>(q->jobs_.size()), std::min(std::max(1, options.max_threads), cores));
  q->base_.threads = threads;
  {
    absl::MutexLock l(&q->mu_);
    q->job_waits_.assign(q->jobs_.size(), 0);
    q->job_ready_.assign(q->jobs_.size(), false);
    q->job_amax_.assign(q->jobs_.size(), 0.0f);
    q->job_digest_.assign(q->jobs_.size(), std::nullopt);
    for (size_t j = 0; j < q->jobs_.size(); ++j) {
      std::vector<uint32_t>& ops = ops_of_job[j];
      std::sort(ops.begin(), ops.end());
      ops.erase(std::unique(ops.begin(), ops.end()), ops.end());
      for (uint32_t op : ops) {
        q->op_left_[op] = 1;
        q->jobs_of_op_[op].push_back(j);
      }
      // No op listed: never ready before Finish (a count no OpLanded can bring to zero).
      q->job_waits_[j] = ops.empty() ? 1 : ops.size();
    }
    q->allowed_ = options.early_threads < 0 ? 0 : std::min(threads, options.early_threads > 0 ? options.early_threads : std::max(1, cores / 2));
  }
  q->after_piece_ = options.after_piece;
  q->digests_ = options.digests;
  q->exchange_ = options.exchange;
  for (int t = 0; t < threads; ++t) q->threads_.emplace_back([p = q.get()] { p->Work(); });
  return q;
}

IncomingQuantization::~IncomingQuantization() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void IncomingQuantization::OpLanded(uint32_t op_index) {
  absl::MutexLock l(&mu_);
  auto it = op_left_.find(op_index);
  if (it == op_left_.end() || it->second == 0) return;
  it->second = 0;
  for (size_t j : jobs_of_op_.at(op_index)) {
    if (job_waits_[j] > 0 && --job_waits_[j] == 0) ReadyLocked(j);
  }
}

// Every op of `job` landed (or Finish): queue its quantising, or, for NVFP4, once its whole group
// is ready, the group's magnitude tasks (the last of them queues the group's quantising).
void IncomingQuantization::ReadyLocked(size_t job) {
  if (job_ready_[job]) return;
  job_ready_[job] = true;
  const int g = jobs_[job].group;
  if (g < 0) {
    queue_.push_back({job, false});
    return;
  }
  Group& gr = groups_[static_cast<size_t>(g)];
  if (++gr.ready < gr.jobs.size()) return;
  gr.amax_left = gr.jobs.size();
  for (size_t j : gr.jobs) queue_.push_back({j, true});
}

absl::Status IncomingQuantization::Run(const Task& t, float& amax) const {
  if (absl::Now() > deadline_) {
    return DeadlineError();
  }
  const Job& job = jobs_[t.job];
  const uint8_t* shadow = job.elements->host.data() + job.shadow->offset_bytes;
  if (t.amax) {
    amax = ShadowAbsMax(inventory_, *job.live, shadow);
    return absl::OkStatus();
  }
  std::optional<float> global;
  if (job.group >= 0) global = groups_[static_cast<size_t>(job.group)].global;  // written before this task was queued
  return QuantizePiece(inventory_, *job.live, shadow, job.elements->host.data(), job.scales->host.data(), global);
}

absl::StatusOr<uint64_t> IncomingQuantization::PieceDigest(const Job& job, int64_t& bytes) const {
  transport::CopyOp el, sc;
  transport::StridedRef el_ref, sc_ref;
  QuantElementsSide(inventory_, *job.live, job.live->box, el, el_ref);
  QuantScalesSide(*job.live, job.live->box, sc, sc_ref);
  digest::Digest d[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const transport::CopyOp& c = i == 0 ? el : sc;
    const transport::StridedRef& r = i == 0 ? el_ref : sc_ref;
    const std::vector<uint8_t>& host = (i == 0 ? job.elements : job.scales)->host;
    int64_t last = r.offset_bytes;
    bool empty = false;
    for (size_t k = 0; k < c.shape.size(); ++k) {
      empty = empty || c.shape[k] <= 0;
      last += (c.shape[k] - 1) * r.strides[k] * c.element_size;
    }
    if (!empty && (r.offset_bytes < 0 || last + c.element_size > static_cast<int64_t>(host.size()))) {
      return absl::InternalError(absl::StrCat("digest of quantised piece ", job.piece, " (tensor ", inventory_.tensors[static_cast<size_t>(job.live->tensor)].name,
                                              "): its ", i == 0 ? "elements reach" : "scales reach", " byte ", last + c.element_size,
                                              " of a staging buffer of ", host.size()));
    }
    ASSIGN_OR_RETURN(d[i], digest::BoxDigest({empty ? nullptr : host.data() + r.offset_bytes, c.shape, r.strides, c.element_size}));
    bytes += c.bytes();
  }
  return digest::QuantizedDigest(d[0], d[1]);
}

void IncomingQuantization::Work() {
  for (;;) {
    Task t;
    {
      absl::MutexLock l(&mu_);
      auto can = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !error_.ok() || quantized_ == jobs_.size() || (!queue_.empty() && running_ < allowed_);
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&can), deadline_)) {
        if (error_.ok()) {
          error_ = DeadlineError();
        }
        return;
      }
      if (stop_ || !error_.ok() || quantized_ == jobs_.size()) return;
      t = queue_.front();
      queue_.pop_front();
      ++running_;
      const absl::Time now = absl::Now();
      first_start_ = std::min(first_start_, now);
      if (!finishing_ && !t.amax) ++early_;
    }
    const absl::Time t0 = absl::Now();
    float amax = 0.0f;
    absl::Status s = Run(t, amax);
    // The piece's quantised bytes were just written: hashed while they are still warm.
    std::optional<uint64_t> digest;
    int64_t hashed = 0;
    if (s.ok() && !t.amax && digests_ && planner::SenderCanQuantize(*jobs_[t.job].live->quant)) {
      absl::StatusOr<uint64_t> d = PieceDigest(jobs_[t.job], hashed);
      if (d.ok()) {
        digest = *d;
      } else {
        s = d.status();
      }
    }
    const absl::Time t1 = absl::Now();
    if (s.ok() && !t.amax && after_piece_) after_piece_(jobs_[t.job].target, jobs_[t.job].piece);
    absl::MutexLock l(&mu_);
    --running_;
    busy_ += t1 - t0;
    last_end_ = std::max(last_end_, t1);
    if (!s.ok()) {
      if (error_.ok()) error_ = std::move(s);
      continue;
    }
    if (!t.amax) {
      job_digest_[t.job] = digest;
      digest_bytes_ += hashed;
      ++quantized_;
      continue;
    }
    Group& gr = groups_[static_cast<size_t>(jobs_[t.job].group)];
    job_amax_[t.job] = amax;
    gr.amax = MaxMagnitude(gr.amax, amax);
    if (--gr.amax_left > 0) continue;
    ++groups_measured_;
    if (gr.partial && exchange_) continue;  // Finish: after the other nodes' magnitudes came
    GlobalScaleLocked(gr);
  }
}

void IncomingQuantization::GlobalScaleLocked(Group& gr) {
  gr.global = NvFp4GlobalScale(gr.amax);
  for (const auto& [scales, offset] : gr.slots) std::memcpy(scales->host.data() + offset, &gr.global, 4);
  for (size_t j : gr.jobs) queue_.push_back({j, false});
}

absl::Status IncomingQuantization::ExchangeLocked(QuantizeResult& out) {
  std::map<int32_t, MagnitudePart> by_tensor;
  for (size_t j = 0; j < jobs_.size(); ++j) {
    if (jobs_[j].group < 0) continue;
    auto [it, added] = by_tensor.try_emplace(jobs_[j].live->tensor);
    MagnitudePart& part = it->second;
    part.tensor = jobs_[j].live->tensor;
    part.amax = added ? job_amax_[j] : MaxMagnitude(part.amax, job_amax_[j]);
    part.boxes.push_back(jobs_[j].live->box);  // for exchanges without a plan (tests); the coordinator uses its own
  }
  std::vector<MagnitudePart> parts;
  parts.reserve(by_tensor.size());
  for (auto& [tensor, part] : by_tensor) parts.push_back(std::move(part));
  bool wait = false;
  for (const Group& gr : groups_) wait = wait || gr.partial;
  // The call may wait for other nodes: not under mu_ (the threads quantise the whole groups).
  mu_.Unlock();
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::map<int32_t, TensorMagnitude>> answer = exchange_(parts, wait);
  const absl::Time t1 = absl::Now();
  mu_.Lock();
  out.exchange_seconds = absl::ToDoubleSeconds(t1 - t0);
  if (!answer.ok()) {
    return absl::Status(answer.status().code(),
                        absl::StrCat("version ", version_, ": NVFP4 magnitudes of the other nodes: ", answer.status().message()));
  }
  out.exchanged_tensors = static_cast<int64_t>(answer->size());
  for (Group& gr : groups_) {
    if (!gr.partial) continue;
    // Largest over every node's parts of the group's tensors; whole once they cover every tensor.
    bool whole = true;
    std::set<int32_t> tensors;
    for (size_t j : gr.jobs) tensors.insert(jobs_[j].live->tensor);
    for (int32_t t : tensors) {
      auto it = answer->find(t);
      if (it == answer->end()) {
        whole = false;
        continue;
      }
      gr.amax = MaxMagnitude(gr.amax, it->second.amax);
      whole = whole && it->second.whole;
    }
    if (whole) {
      gr.partial = false;
      --out.partial_global_scales;
    }
    GlobalScaleLocked(gr);
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizeResult> IncomingQuantization::Finish() {
  const absl::Time t0 = absl::Now();
  absl::MutexLock l(&mu_);
  finishing_ = true;
  allowed_ = base_.threads;
  const int64_t ready_before = std::count(job_ready_.begin(), job_ready_.end(), true);
  for (size_t j = 0; j < jobs_.size(); ++j) ReadyLocked(j);
  QuantizeResult out = base_;
  if (exchange_ && !groups_.empty()) {
    auto measured = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !error_.ok() || groups_measured_ == groups_.size(); };
    const bool measured_in_time = mu_.AwaitWithDeadline(absl::Condition(&measured), deadline_);
    if (!error_.ok()) return error_;
    if (!measured_in_time) return DeadlineError();
    RETURN_IF_ERROR(ExchangeLocked(out));
  }
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !error_.ok() || quantized_ == jobs_.size(); };
  const bool in_time = mu_.AwaitWithDeadline(absl::Condition(&done), deadline_);
  if (!error_.ok()) return error_;
  if (!in_time) return DeadlineError();
  if (!jobs_.empty()) out.seconds = absl::ToDoubleSeconds(last_end_ - first_start_);
  out.busy_seconds = absl::ToDoubleSeconds(busy_);
  out.finish_seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  out.early_pieces = early_;
  out.ready_pieces = ready_before;
  for (size_t j = 0; j < jobs_.size(); ++j) {
    if (!job_digest_[j].has_value()) continue;
    const Job& job = jobs_[j];
    out.digests.push_back({targets_[job.target].worker, job.piece, job.live->tensor, job.live->box, *job_digest_[j]});
  }
  out.digest_bytes = digest_bytes_;
  return out;
}

absl::StatusOr<QuantizeResult> QuantizeStaging(const planner::Inventory& inventory, const std::vector<QuantizeTarget>& targets,
                                               uint64_t version, absl::Time deadline) {
  std::vector<QuantizeTarget> all = targets;
  for (QuantizeTarget& t : all) t.landing.clear();
  ASSIGN_OR_RETURN(std::unique_ptr<IncomingQuantization> q, IncomingQuantization::Start(inventory, std::move(all), version, deadline));
  return q->Finish();
}

}  // namespace wb::daemon::node

#include "daemon/node/node_staging.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/log.h"

namespace wb::daemon::node {

NodeStaging::NodeStaging(Options options) : options_(std::move(options)) {
  // Idle staging is bounded by the staging budget (what versions may hold anyway) and returned to
  // the system after a few minutes without a version that wants it.
  StagingPool::Options po;
  po.max_idle_bytes = options_.budget_bytes;
  po.clock = options_.clock;
  pool_ = std::make_shared<StagingPool>(po);
  budget_ = StagingBudget::Create(options_.node_id, options_.budget_bytes);
}

std::string NodeStaging::BaseTag(const std::string& model, const std::string& worker, size_t buffer, uint64_t version) {
  return absl::StrCat(model, "\n", worker, "\nb", buffer, "\nv", version);
}

std::vector<uint8_t> NodeStaging::TakeHost(int64_t size, const std::string& tag, bool* tag_matched) {
  bool reused = false;
  std::vector<uint8_t> out = pool_->Take(size, &reused, tag, tag_matched);
  if (size > 0) options_.metrics->StagingTaken(options_.node_id, reused, static_cast<uint64_t>(size));
  return out;
}

void NodeStaging::Lend(const std::shared_ptr<Bytes>& staging) const {
  if (staging == nullptr) return;
  for (const StagedBuffer& b : *staging) {
    if (!b.pool_tag.empty() && !b.host.empty()) pool_->Lend(b.pool_tag, std::weak_ptr<void>(std::shared_ptr<void>(staging)));
  }
}

NodeStaging::Base NodeStaging::TakeBase(int64_t size, const std::string& tag, absl::Time deadline) {
  Base out;
  StagingPool::Tagged t = pool_->TakeTagged(size, tag, deadline);
  if (!t.buffer.empty()) {
    out.host = std::move(t.buffer);
    out.matched = true;
    if (size > 0) options_.metrics->StagingTaken(options_.node_id, /*reused=*/true, static_cast<uint64_t>(size));
    return out;
  }
  out.held = std::static_pointer_cast<Bytes>(std::move(t.holder));
  out.host = TakeHost(size);
  if (out.held == nullptr) {
    // Neither back nor held: given to another taker or freed (the pool's tagged_given_away /
    // tagged_freed counters say which). Deltas into this rollout's receiver-quantised shadows are
    // refused this version and resent in full.
    StagingPool::Stats st = pool_->stats();
    Log(LogLevel::kInfo, "delta base staging not found",
        {{"node", options_.node_id}, {"bytes", size}, {"tagged_given_away", st.tagged_given_away}, {"tagged_freed", st.tagged_freed}});
  }
  return out;
}

void NodeStaging::PrewarmStaging(int64_t size) {
  if (pool_->Prewarm(size, std::max<int64_t>(0, budget_->budget() - budget_->in_use()))) {
    options_.metrics->StagingPoolBytes(options_.node_id, pool_->stats().idle_bytes);
  }
}

void NodeStaging::Tick() {
  pool_->Trim();
  options_.metrics->StagingPoolBytes(options_.node_id, pool_->stats().idle_bytes);
}

std::shared_ptr<NodeStaging::Bytes> NodeStaging::NewBytes(size_t n, std::vector<std::shared_ptr<StagingBudget::Charge>> charges) {
  std::weak_ptr<StagingPool> pool = pool_;
  std::shared_ptr<StagingBudget> budget = budget_;
  return std::shared_ptr<Bytes>(new Bytes(n), [pool, budget, charges = std::move(charges)](Bytes* b) mutable {
    std::shared_ptr<StagingPool> p = pool.lock();
    if (p) {
      for (StagedBuffer& sb : *b) p->Give(std::move(sb.host), std::move(sb.pool_tag));
    }
    delete b;
    charges.clear();  // released first: what the pool may keep idle is what the budget leaves
    // Idle pooled memory counts too: in use + idle stays within the node's budget.
    if (p) p->TrimTo(std::max<int64_t>(0, budget->budget() - budget->in_use()));
  });
}

std::shared_ptr<NodeStaging::Bytes> NodeStaging::KeepWith(std::shared_ptr<Bytes> bytes, std::shared_ptr<StagingBudget::Charge> charge) {
  auto holder = std::make_shared<std::pair<std::shared_ptr<Bytes>, std::shared_ptr<StagingBudget::Charge>>>(std::move(bytes), std::move(charge));
  Bytes* raw = holder->first.get();
  return std::shared_ptr<Bytes>(std::move(holder), raw);
}

absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> NodeStaging::TryDeviceStaging(int device, int64_t size, const std::string& label) {
  if (!gpu_staging()) return std::shared_ptr<transport::DeviceMemory>();
  auto m = options_.device_staging->TryAllocate(device, size, label);
  if (!m.ok()) return Annotate(m.status(), absl::StrCat("GPU staging for ", label));
  if (*m == nullptr) {
    // Not an error: over the per-GPU budget (or the GPU is full): host staging, as without a GPU.
    Log(LogLevel::kInfo, "GPU staging unavailable, staging in host memory",
        {{"node", options_.node_id}, {"what", label}, {"gpu", device}, {"bytes", size},
         {"used", options_.device_staging->used(device)}, {"budget", options_.device_staging->budget_per_gpu()}});
  }
  return m;
}

absl::Status NodeStaging::ReadLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& buffers,
                                   const std::vector<std::shared_ptr<CudaImport>>& cuda, Bytes& out, const std::string& label,
                                   absl::Time deadline, bool on_gpu) {
  out.clear();
  out.resize(buffers.size());
  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  std::vector<int64_t> size;
  transport::Transport* ct = nullptr;
  transport::Batch device_batch;
  std::vector<transport::RegionHandle> regions;  // on ct
  absl::Cleanup cleanup = [&] {
    for (auto& h : regions) (void)ct->Release(h);
  };
  for (size_t j = 0; j < buffers.size(); ++j) {
    if (buffers[j]) {
      out[j].host = TakeHost(buffers[j]->size());  // every byte is copied over below
      src.push_back(static_cast<const uint8_t*>(buffers[j]->data()));
      dst.push_back(out[j].host.data());
      size.push_back(buffers[j]->size());
      continue;
    }
    if (j >= cuda.size() || cuda[j] == nullptr) return absl::InternalError(absl::StrCat(label, ": buffer ", j, " is neither host nor CUDA"));
    // CUDA: device -> GPU staging (device to device) when allowed, else device -> host; both on
    // the cuda_ipc transport (host memory registered with it: pinned when possible).
    ct = cuda[j]->t;
    const int64_t n = cuda[j]->size;
    if (on_gpu) {
      ASSIGN_OR_RETURN(out[j].device, TryDeviceStaging(cuda[j]->device, n, absl::StrCat(label, " b", j)));
      options_.metrics->Staged(options_.node_id, out[j].device ? "gpu" : "host", "snapshot", static_cast<uint64_t>(n));
    }
    transport::MemorySpec spec;
    if (out[j].device) {
      spec.kind = transport::MemoryKind::kCuda;
      spec.base = out[j].device->data();
      spec.device = out[j].device->device();
    } else {
      out[j].host = TakeHost(n);
      spec.kind = transport::MemoryKind::kHost;
      spec.base = out[j].host.data();
    }
    spec.size_bytes = n;
    spec.label = absl::StrCat(label, " staging b", j);
    ASSIGN_OR_RETURN(transport::RegionHandle h, ct->RegisterMemory(spec));
    regions.push_back(h);
    transport::CopyOp op;
    op.shape = {n};
    op.element_size = 1;
    op.src = {cuda[j]->h, 0, {1}};
    op.dst = {h, 0, {1}};
    device_batch.ops.push_back(std::move(op));
  }
  if (!device_batch.ops.empty()) {
    ASSIGN_OR_RETURN(transport::BatchId id, ct->Post(device_batch));
    RETURN_IF_ERROR_WITH(ct->Wait(id, deadline), absl::StrCat(label, ": copying CUDA buffers"));
  }
  // The worker may have truncated its segments (before: refused; during: the SIGBUS guard let the
  // copy finish on zero pages, and the snapshot is refused).
  RETURN_IF_ERROR(CheckLive(buffers, label));
  RETURN_IF_ERROR(options_.copier->CopyFlat(src, dst, size, label, deadline));
  return CheckLive(buffers, label);
}

}  // namespace wb::daemon::node

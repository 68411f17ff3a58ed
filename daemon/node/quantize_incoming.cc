#include "daemon/node/quantize_incoming.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/box_copy.h"
#include "daemon/quantize.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "base/status_macros.h"

namespace wb::daemon::node {

absl::StatusOr<QuantizeResult> QuantizeStaging(const planner::Inventory& inventory, const std::vector<QuantizeTarget>& targets,
                                               uint64_t version, absl::Time deadline) {
  struct Job {
    const planner::Piece* live;    // the quantised piece (its place and scales in staging)
    const planner::Piece* shadow;  // where its canonical bytes landed
    StagedBuffer* elements;
    StagedBuffer* scales;
    int group = -1;                // NVFP4: index into `groups` (the pieces sharing its global scale)
  };
  // NVFP4 global scales: one per (rollout, scale buffer, offset); every piece naming it counts.
  struct Group {
    StagedBuffer* scales;
    int64_t offset;
    float amax = 0.0f;
    float global = 0.0f;
  };
  std::vector<Group> groups;
  std::vector<Job> jobs;
  QuantizeResult out;
  for (const QuantizeTarget& t : targets) {
    StagedBytes& staging = *t.staging;
    for (size_t k = 0; k < t.live->pieces.size(); ++k) {
      const planner::Piece& p = t.live->pieces[k];
      if (!p.quant.has_value()) continue;
      if (t.sender_quantized != nullptr && t.sender_quantized->count(static_cast<int32_t>(k)) > 0) continue;
      const size_t b = static_cast<size_t>(p.buffer), sb = static_cast<size_t>(p.quant->scale_buffer);
      if (b >= staging.size() || sb >= staging.size() || staging[b].device != nullptr || staging[sb].device != nullptr) {
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
      Job job{&p, &sp, &staging[b], &staging[sb]};
      if (p.quant->global_scale_offset_bytes >= 0) {
        const int64_t g = p.quant->global_scale_offset_bytes;
        if (g + 4 > static_cast<int64_t>(staging[sb].size())) {
          return absl::InternalError(absl::StrCat("version ", version, ": rollout ", t.worker, " tensor ", inventory.tensors[p.tensor].name,
                                                  ": global scale outside its staging"));
        }
        auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& gr) { return gr.scales == &staging[sb] && gr.offset == g; });
        if (it == groups.end()) it = groups.insert(groups.end(), Group{&staging[sb], g});
        job.group = static_cast<int>(it - groups.begin());
      }
      jobs.push_back(job);
      out.bytes += sh_bytes;
    }
  }
  out.pieces = static_cast<int64_t>(jobs.size());
  if (jobs.empty()) return out;
  const absl::Time t0 = absl::Now();
  // Threads take pieces in turn (big pieces dominate; they are independent). Nothing else of this
  // version runs meanwhile, and one thread quantises ~2-3 GB/s (//bench:quantize), so up to 16.
  const int threads = static_cast<int>(std::min<size_t>(jobs.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency()))));
  absl::Mutex err_mu;
  absl::Status first;
  auto fail = [&](absl::Status s) {
    absl::MutexLock l(&err_mu);
    if (first.ok()) first = std::move(s);
  };
  // Runs fn(j) for j in [0, n) on `threads` threads taking indices in turn (big pieces dominate;
  // they are independent); stops taking new ones after an error or past the deadline.
  auto for_each = [&](size_t n, const std::function<absl::Status(size_t)>& fn) {
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    auto work = [&] {
      for (size_t j = next++; j < n && !failed.load(); j = next++) {
        absl::Status s = absl::Now() > deadline
                             ? absl::DeadlineExceededError(absl::StrCat("version ", version, ": quantising did not finish before the transfer deadline"))
                             : fn(j);
        if (!s.ok()) {
          failed = true;
          fail(std::move(s));
          return;
        }
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::min<int>(threads, static_cast<int>(n)); ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  };
  // NVFP4 first: each group's largest magnitude over all its pieces' shadows (each piece's on the
  // threads, then the group's max), then its global scale, stored once (the pieces' QuantizePiece
  // calls then share it; threads only read it).
  if (!groups.empty()) {
    std::vector<size_t> grouped;
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (jobs[j].group >= 0) grouped.push_back(j);
    }
    std::vector<float> piece_amax(grouped.size(), 0.0f);
    for_each(grouped.size(), [&](size_t k) {
      const Job& job = jobs[grouped[k]];
      piece_amax[k] = ShadowAbsMax(inventory, *job.live, job.elements->host.data() + job.shadow->offset_bytes);
      return absl::OkStatus();
    });
    RETURN_IF_ERROR(first);
    for (size_t k = 0; k < grouped.size(); ++k) {
      Group& gr = groups[static_cast<size_t>(jobs[grouped[k]].group)];
      const float m = piece_amax[k];
      gr.amax = (std::isnan(m) || m > gr.amax) ? m : gr.amax;
    }
    for (Group& gr : groups) {
      gr.global = NvFp4GlobalScale(gr.amax);
      std::memcpy(gr.scales->host.data() + gr.offset, &gr.global, 4);
    }
  }
  for_each(jobs.size(), [&](size_t j) {
    const Job& job = jobs[j];
    std::optional<float> global;
    if (job.group >= 0) global = groups[static_cast<size_t>(job.group)].global;
    return QuantizePiece(inventory, *job.live, job.elements->host.data() + job.shadow->offset_bytes, job.elements->host.data(),
                         job.scales->host.data(), global);
  });
  RETURN_IF_ERROR(first);
  out.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  out.threads = threads;
  return out;
}

}  // namespace wb::daemon::node

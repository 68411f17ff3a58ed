#include "daemon/node/executor.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "daemon/nccl_route.h"

namespace wb::daemon::node {
namespace {

using transport::MemoryKind;
using transport::RegionHandle;
using transport::Transport;

transport::CopyOp WholeCopy(RegionHandle from, RegionHandle to, int64_t size) {
  transport::CopyOp op;
  op.shape = {size};
  op.element_size = 1;
  op.src = {from, 0, {1}};
  op.dst = {to, 0, {1}};
  return op;
}

// One run of a plan. Members are touched by the executor's thread, except where noted.
class Run {
 public:
  Run(const ExecPlan& plan, const std::map<std::string, RegionMemory>& memory, const ExecTransports& t, ChannelSetup& setup,
      const ExecOptions& o, ExecResult& result)
      : plan_(plan), mem_(memory), t_(t), setup_(setup), o_(o), result_(result) {}

  // Releases every region on every path (after every posted batch was waited for).
  ~Run() {
    for (auto& [t, h] : registered_) (void)t->Release(h);
  }

  absl::Status Go() {
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(RegisterSameNode());
    RETURN_IF_ERROR(RegisterCross());
    RETURN_IF_ERROR(RegisterNccl());
    RETURN_IF_ERROR(PrepareDeltas());
    RETURN_IF_ERROR(Publish());
    RETURN_IF_ERROR(SetupChannels());
    const absl::Time t1 = absl::Now();
    result_.setup_s = absl::ToDoubleSeconds(t1 - t0);
    absl::Status s = RunBuckets();
    if (s.ok() && delta_ != nullptr) s = DeltaTail();
    if (s.ok()) s = RunAfterDeltas();
    if (delta_ != nullptr) result_.delta = delta_->stats();
    result_.buckets_s = absl::ToDoubleSeconds(absl::Now() - t1);
    return s;
  }

 private:
  struct Posted {
    const Route* route;
    Transport* t;
    transport::BatchId id;
  };

  const RegionMemory* Find(const std::string& key) const {
    auto it = mem_.find(key);
    return it == mem_.end() ? nullptr : &it->second;
  }

  absl::Status Missing(const std::string& key) const { return absl::InternalError(absl::StrCat("region ", key, " missing (", o_.label, ")")); }

  absl::StatusOr<RegionHandle> Register(Transport* t, const std::string& key, const RegionMemory& m) {
    if (m.cuda_import.id != 0) return m.cuda_import;  // owned by the worker's import, not by this version
    transport::MemorySpec spec;
    spec.kind = m.kind;
    spec.base = m.base;
    spec.size_bytes = m.size;
    spec.device = m.device;
    spec.label = absl::StrCat(o_.label, " ", key);
    ASSIGN_OR_RETURN(RegionHandle h, t->RegisterMemory(spec));
    absl::MutexLock l(&mu_);
    registered_.push_back({t, h});
    return h;
  }

  // The channel a route's batches travel on ("" for same-node copies).
  static const std::string& ChannelOf(const Route& r) {
    static const std::string kNone;
    return r.kind == RouteKind::kPeer || r.kind == RouteKind::kNccl ? r.channel : kNone;
  }

  // Batches on a channel are counted while in flight (ExecOptions::channel_post / channel_waited):
  // the node tears down an aborted execution's shared channel only when it has batches on it.
  absl::StatusOr<transport::BatchId> PostOn(Transport* t, const transport::Batch& batch, const std::string& channel) {
    const bool counted = !channel.empty() && o_.channel_post != nullptr;
    if (counted) RETURN_IF_ERROR(o_.channel_post(channel));
    absl::StatusOr<transport::BatchId> id = t->Post(batch);
    if (counted && !id.ok() && o_.channel_waited) o_.channel_waited(channel);
    return id;
  }
  absl::Status WaitOn(Transport* t, transport::BatchId id, const std::string& channel) {
    absl::Status s = t->Wait(id, o_.deadline);
    if (!channel.empty() && o_.channel_post != nullptr && o_.channel_waited) o_.channel_waited(channel);
    return s;
  }

  absl::Status PostAndWait(Transport* t, const transport::Batch& batch, const std::string& what) {
    if (batch.ops.empty()) return absl::OkStatus();
    ASSIGN_OR_RETURN(transport::BatchId id, t->Post(batch));
    RETURN_IF_ERROR_WITH(t->Wait(id, o_.deadline), absl::StrCat(o_.label, ": ", what));
    return absl::OkStatus();
  }

  // Same-node host copies on the host transport, copies with a CUDA side on cuda_ipc.
  absl::Status RegisterSameNode() {
    for (const std::string& key : plan_.host_keys) {
      const RegionMemory* m = Find(key);
      if (m == nullptr) return Missing(key);
      if (t_.local == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no same-node host transport"));
      ASSIGN_OR_RETURN(local_h_[key], Register(t_.local, key, *m));
    }
    for (const std::string& key : plan_.cuda_keys) {
      const RegionMemory* m = Find(key);
      if (m == nullptr) return Missing(key);
      if (t_.cuda == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no cuda_ipc transport"));
      ASSIGN_OR_RETURN(cuda_h_[key], Register(t_.cuda, key, *m));
    }
    return absl::OkStatus();
  }

  // A CUDA source of cross-node ops (a sync trainer's live buffer, or a snapshot on its GPU) is
  // copied to host memory once, before the first bucket: the host channel reaches host memory only,
  // and sources do not change during a version.
  absl::Status RegisterCross() {
    std::map<std::string, RegionMemory> host_copy;
    transport::Batch d2h;
    for (const std::string& key : plan_.cross_keys) {
      const RegionMemory* m = Find(key);
      if (m == nullptr) return Missing(key);
      if (m->kind != MemoryKind::kCuda) continue;
      if (t_.cuda == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no cuda_ipc transport"));
      host_bufs_.push_back(std::make_unique<std::vector<uint8_t>>(static_cast<size_t>(m->size)));
      RegionMemory hm{MemoryKind::kHost, host_bufs_.back()->data(), m->size, -1, {}};
      ASSIGN_OR_RETURN(RegionHandle src, Register(t_.cuda, key, *m));
      ASSIGN_OR_RETURN(RegionHandle dst, Register(t_.cuda, key + " (host copy)", hm));
      d2h.ops.push_back(WholeCopy(src, dst, hm.size));
      host_copy[key] = hm;
    }
    RETURN_IF_ERROR(PostAndWait(t_.cuda, d2h, "copying CUDA sources to host for other nodes"));
    if (!plan_.cross_keys.empty() && t_.cross == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no cross-node host transport"));
    for (const std::string& key : plan_.cross_keys) {
      auto hc = host_copy.find(key);
      ASSIGN_OR_RETURN(cross_h_[key], Register(t_.cross, key, hc != host_copy.end() ? hc->second : *Find(key)));
    }
    return absl::OkStatus();
  }

  // nccl regions, each on its lane's transport: GPU staging on the lane's GPU is registered as is;
  // any other source (a worker's imported buffer, a snapshot in host memory or on a GPU without a
  // lane) is first copied whole into GPU staging on the lane's GPU.
  absl::Status RegisterNccl() {
    transport::Batch bounce;
    for (const auto& [key, lane] : plan_.lanes.lane_of) {
      auto lt = t_.lanes.find(lane);
      if (lt == t_.lanes.end()) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no nccl lane ", NcclLaneName(lane)));
      const RegionMemory* src = Find(key);
      if (src == nullptr) return Missing(key);
      if (src->kind == MemoryKind::kCuda && src->cuda_import.id == 0 && src->device == lane) {
        ASSIGN_OR_RETURN(nccl_h_[key], Register(lt->second, key, *src));
        continue;
      }
      if (key[0] != 'w' || t_.cuda == nullptr || !o_.device_staging) {
        return absl::InternalError(absl::StrCat("region ", key, " (", o_.label, ") is routed over nccl but is not GPU staging"));
      }
      const std::string what = absl::StrCat(o_.label, " ", key, " (nccl source copy)");
      ASSIGN_OR_RETURN(std::shared_ptr<transport::DeviceMemory> dev, o_.device_staging(lane, src->size, what));
      if (dev == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(what, ": ", src->size, " bytes of GPU staging on GPU ", lane,
                                                         " exceed --gpu_staging_bytes or the GPU's free memory"));
      }
      if (o_.on_bounce) o_.on_bounce(static_cast<uint64_t>(src->size));
      device_bufs_.push_back(dev);
      RegionMemory dm{MemoryKind::kCuda, static_cast<uint8_t*>(dev->data()), src->size, dev->device(), {}};
      ASSIGN_OR_RETURN(RegionHandle from, Register(t_.cuda, key, *src));
      ASSIGN_OR_RETURN(RegionHandle to, Register(t_.cuda, what, dm));
      bounce.ops.push_back(WholeCopy(from, to, src->size));
      ASSIGN_OR_RETURN(nccl_h_[key], Register(lt->second, key, dm));
    }
    return PostAndWait(t_.cuda, bounce, "copying nccl sources to their lanes' GPUs");
  }

  // Lossless deltas: the slots, the "d.<peer>" regions on the host channel (exported with the
  // others), and the encodes start at once (they overlap channel setup and earlier buckets).
  absl::Status PrepareDeltas() {
    auto host = [this](const std::string& key) -> std::optional<std::pair<uint8_t*, int64_t>> {
      const RegionMemory* m = Find(key);
      if (m == nullptr || m->kind != MemoryKind::kHost || m->base == nullptr || m->cuda_import.id != 0) return std::nullopt;
      return std::pair<uint8_t*, int64_t>{m->base, m->size};
    };
    delta_options_ = o_.deltas;  // DeltaRun keeps a reference: a member declared before delta_
    if (o_.on_op_landed) {
      delta_options_.decoded = [prev = std::move(delta_options_.decoded), landed = o_.on_op_landed](const RouteOp& op) {
        if (prev) prev(op);
        landed(op);
      };
    }
    ASSIGN_OR_RETURN(delta_, DeltaRun::Make(plan_, delta_options_, o_.version, o_.label, host));
    if (delta_ == nullptr) return absl::OkStatus();
    for (auto& [key, m] : delta_->Regions()) {
      if (t_.cross == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no cross-node host transport"));
      ASSIGN_OR_RETURN(cross_h_[key], Register(t_.cross, key, RegionMemory{MemoryKind::kHost, m.first, m.second, -1, {}}));
    }
    delta_->Start();
    return absl::OkStatus();
  }

  // Posts the protocol's own batches (lengths or refusals) and waits for all of them.
  absl::Status PostDeltaBatches(const std::vector<DeltaBatchPlan>& plans, const char* what) {
    std::vector<std::pair<transport::BatchId, const std::string*>> posted;  // on the host channel
    absl::Status error;
    for (const DeltaBatchPlan& p : plans) {
      auto rh = remote_h_.find(p.channel);
      auto id = result_.channels.find(p.channel);
      if (rh == remote_h_.end() || id == result_.channels.end()) {
        error = absl::InternalError(absl::StrCat(o_.label, ": channel to node ", p.peer, " was not set up"));
        break;
      }
      transport::Batch batch;
      batch.tag = p.tag;
      batch.group = o_.batch_group;
      batch.peer = id->second;
      batch.checksum = true;
      for (const DeltaCopy& c : p.copies) {
        auto sh = c.src_local ? cross_h_.find(c.src_key) : rh->second.find(c.src_key);
        auto dh = c.src_local ? rh->second.find(c.dst_key) : cross_h_.find(c.dst_key);
        if (sh == (c.src_local ? cross_h_.end() : rh->second.end()) || dh == (c.src_local ? rh->second.end() : cross_h_.end())) {
          error = absl::InternalError(absl::StrCat(o_.label, ": delta region ", c.src_key, " or ", c.dst_key, " of node ", p.peer, " unknown"));
          break;
        }
        batch.ops.push_back(DeltaCopyOp(c, sh->second, dh->second));
      }
      if (!error.ok()) break;
      absl::StatusOr<transport::BatchId> bid = PostOn(t_.cross, batch, p.channel);
      if (!bid.ok()) {
        error = Annotate(bid.status(), absl::StrCat(what, " with node ", p.peer));
        break;
      }
      posted.push_back({*bid, &p.channel});
    }
    for (auto& [bid, channel] : posted) {
      absl::Status s = WaitOn(t_.cross, bid, *channel);
      if (!s.ok() && error.ok()) error = Annotate(s, what);
    }
    return error;
  }

  static transport::CopyOp DeltaCopyOp(const DeltaCopy& c, RegionHandle src, RegionHandle dst) {
    transport::CopyOp op;
    op.shape = {c.bytes};
    op.element_size = 1;
    op.src = {src, c.src_off, {1}};
    op.dst = {dst, c.dst_off, {1}};
    return op;
  }

  // Bucket `b`'s lengths: after its encodes, before any of its routes is posted.
  absl::Status DeltaLengths(uint32_t b) {
    ASSIGN_OR_RETURN(std::vector<DeltaBatchPlan> plans, delta_->LengthsBatches(b, o_.deadline));
    if (plans.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(PostDeltaBatches(plans, "exchanging delta lengths"));
    return delta_->LengthsLanded(b);
  }

  // After the buckets: refusals, then one full resend of every refused op (both directions).
  absl::Status DeltaTail() {
    ASSIGN_OR_RETURN(std::vector<DeltaBatchPlan> refusals, delta_->RefusalsBatches(o_.deadline));
    if (!refusals.empty()) {
      RETURN_IF_ERROR(PostDeltaBatches(refusals, "exchanging delta refusals"));
      fallback_ = delta_->FallbackRoutes();
      for (const Route& r : fallback_) Post(r);
      WaitBefore();
      absl::MutexLock l(&mu_);
      if (!first_.ok()) return Annotate(first_, "resending refused deltas in full");
    }
    RETURN_IF_ERROR(delta_->Finish(o_.deadline));
    // Every decoded or resent box is in place: the held routes are done now (digests hash them).
    absl::MutexLock l(&mu_);
    for (auto& [r, kind] : held_done_) o_.on_batch_done(*r, kind);
    held_done_.clear();
    return absl::OkStatus();
  }

  absl::Status Publish() {
    std::map<std::string, std::map<std::string, std::string>> desc;
    for (auto& [key, h] : cross_h_) {
      ASSIGN_OR_RETURN(desc[t_.cross->capabilities().kind][key], t_.cross->ExportDescriptor(h));
    }
    for (auto& [key, h] : nccl_h_) {
      const int lane = plan_.lanes.lane_of.at(key);
      ASSIGN_OR_RETURN(desc[NcclLaneName(lane)][key], t_.lanes.at(lane)->ExportDescriptor(h));
    }
    setup_.Publish(std::move(desc));
    return absl::OkStatus();
  }

  Transport* ChannelTransport(const ChannelPlan& c) const {
    if (c.my_lane < 0) return t_.cross;
    auto it = t_.lanes.find(c.my_lane);
    return it == t_.lanes.end() ? nullptr : it->second;
  }

  // Channels in the plan's global order, up to kMaxChannelSetups at once: a channel starts only
  // after every smaller one of this node has started, so the smallest unfinished channel always has
  // both nodes at it (no cycle, whatever the number of threads).
  absl::Status SetupChannels() {
    const std::vector<ChannelPlan>& tasks = plan_.channels;
    size_t next = 0;
    absl::Status error;
    auto work = [&] {
      while (true) {
        size_t i = 0;
        {
          absl::MutexLock l(&mu_);
          if (!error.ok() || next >= tasks.size()) return;
          i = next++;
        }
        const ChannelPlan& c = tasks[i];
        Transport* t = ChannelTransport(c);
        absl::StatusOr<ChannelLink> link =
            t == nullptr ? absl::FailedPreconditionError(absl::StrCat(o_.label, ": no transport '", c.mine, "' for node ", c.peer))
                         : setup_.Setup(c, t, o_.deadline);
        absl::Status s = link.status();
        std::map<std::string, RegionHandle> imported;
        if (s.ok()) {
          for (auto& [key, d] : link->regions) {
            auto h = t->ImportDescriptor(d);
            if (!h.ok()) {
              s = Annotate(h.status(), absl::StrCat("importing region ", key, " of node ", c.peer, " (", c.theirs, ")"));
              break;
            }
            imported[key] = *h;
          }
        }
        absl::MutexLock l(&mu_);
        for (auto& [key, h] : imported) registered_.push_back({t, h});
        if (link.ok()) result_.channels[c.name] = link->id;
        if (!s.ok()) {
          if (error.ok()) error = s;
          return;
        }
        remote_h_[c.name] = std::move(imported);
      }
    };
    const size_t threads = std::min(tasks.size(), kMaxChannelSetups);
    if (threads <= 1) {
      work();
    } else {
      std::vector<std::thread> pool;
      for (size_t i = 0; i < threads; ++i) pool.emplace_back(work);
      for (std::thread& t : pool) t.join();
    }
    return error;
  }

  // The transport batch of a route: handles filled in.
  absl::StatusOr<transport::Batch> BatchOf(const Route& r, Transport*& t) const {
    transport::Batch batch;
    batch.tag = r.bucket == 0xFFFFFFu ? FallbackTag(o_.version) : r.after_deltas ? AfterDeltasTag(o_.version, r.bucket) : BatchTag(o_.version, r.bucket);
    batch.checksum = r.checksum;
    if (!ChannelOf(r).empty()) batch.group = o_.batch_group;
    const std::map<std::string, RegionHandle>* mine = nullptr;
    const std::map<std::string, RegionHandle>* theirs = nullptr;
    switch (r.kind) {
      case RouteKind::kHost:
        t = t_.local;
        mine = theirs = &local_h_;
        break;
      case RouteKind::kCuda:
        t = t_.cuda;
        mine = theirs = &cuda_h_;
        break;
      case RouteKind::kPeer:
      case RouteKind::kNccl: {
        t = r.kind == RouteKind::kPeer ? t_.cross : (t_.lanes.count(r.lane.first) ? t_.lanes.at(r.lane.first) : nullptr);
        mine = r.kind == RouteKind::kPeer ? &cross_h_ : &nccl_h_;
        auto rh = remote_h_.find(r.channel);
        auto id = result_.channels.find(r.channel);
        if (rh == remote_h_.end() || id == result_.channels.end()) {
          return absl::InternalError(absl::StrCat(o_.label, ": channel to node ", r.peer, " was not set up"));
        }
        theirs = &rh->second;
        batch.peer = id->second;
        break;
      }
    }
    if (t == nullptr) return absl::FailedPreconditionError(absl::StrCat(o_.label, ": no transport for ", r.what));
    for (const RouteOp& op : r.ops) {
      const auto& sm = op.src_local ? *mine : *theirs;
      const auto& dm = op.dst_local ? *mine : *theirs;
      auto sh = sm.find(op.src_key), dh = dm.find(op.dst_key);
      if (sh == sm.end() || dh == dm.end()) {
        return absl::InternalError(absl::StrCat("op ", op.op_index, ": region ", op.src_key, " or ", op.dst_key, " unknown (", r.what, ")"));
      }
      transport::CopyOp c = op.copy;
      c.src.region = sh->second;
      c.dst.region = dh->second;
      batch.ops.push_back(std::move(c));
    }
    // Deltas: slots that travel as streams replace their full copies (same position on both nodes).
    if (delta_ != nullptr && r.kind == RouteKind::kPeer && r.bucket != 0xFFFFFFu) {
      for (const auto& [pos, dc] : delta_->Substitutions(r)) {
        auto sh = dc.src_local ? mine->find(dc.src_key) : theirs->find(dc.src_key);
        auto dh = dc.src_local ? theirs->find(dc.dst_key) : mine->find(dc.dst_key);
        if (sh == (dc.src_local ? mine->end() : theirs->end()) || dh == (dc.src_local ? theirs->end() : mine->end())) {
          return absl::InternalError(absl::StrCat(o_.label, ": delta region ", dc.src_key, " or ", dc.dst_key, " unknown (", r.what, ")"));
        }
        batch.ops[pos] = DeltaCopyOp(dc, sh->second, dh->second);
      }
    }
    return batch;
  }

  void Finish(const Route& r, Transport* t, const absl::Status& s) {
    // Delta streams are decoded on worker threads: the route's bytes are final after DeltaTail.
    std::set<const RouteOp*> decoded_later;  // reported by DeltaOptions::decoded (or resent in full)
    const bool decoding = s.ok() && delta_ != nullptr && delta_->Landed(r, o_.on_op_landed ? &decoded_later : nullptr);
    absl::MutexLock l(&mu_);
    if (!s.ok() && first_.ok()) first_ = Annotate(s, absl::StrCat("bucket ", r.bucket, ", ", r.what));
    if (!s.ok()) return;
    if (o_.on_op_landed) {
      for (const RouteOp& op : r.ops) {
        if (op.dst_local && decoded_later.count(&op) == 0) o_.on_op_landed(op);
      }
    }
    // Link time = the peer's first post -> this batch's completion (the union over its batches).
    if (o_.on_batch_done && decoding) {
      held_done_.push_back({&r, t->capabilities().kind});
    } else if (o_.on_batch_done) {
      o_.on_batch_done(r, t->capabilities().kind);
    }
    LinkStat& ls = result_.links[r.peer];
    ls.bytes += static_cast<uint64_t>(r.bytes);
    ls.seconds = std::max(ls.seconds, absl::ToDoubleSeconds(absl::Now() - first_post_[r.peer]));
    if (o_.bytes_done != nullptr) *o_.bytes_done += static_cast<uint64_t>(r.incoming);
  }

  bool Failed() {
    absl::MutexLock l(&mu_);
    return !first_.ok();
  }

  void Fail(const absl::Status& s) {
    absl::MutexLock l(&mu_);
    if (first_.ok()) first_ = s;
  }

  // Posts `r`; on success it is outstanding until WaitBefore retires it.
  void Post(const Route& r) {
    Transport* t = nullptr;
    absl::StatusOr<transport::Batch> batch = BatchOf(r, t);
    if (batch.ok() && o_.prepare_batch) o_.prepare_batch(r, *batch);
    {
      absl::MutexLock l(&mu_);
      first_post_.emplace(r.peer, absl::Now());
    }
    absl::StatusOr<transport::BatchId> id = batch.ok() ? PostOn(t, *batch, ChannelOf(r)) : batch.status();
    if (!id.ok()) {
      Finish(r, t, id.status());
      return;
    }
    outstanding_.push_back({&r, t, *id});
  }

  // Deltas: retires the outstanding batches that already completed (Poll), so the streams of
  // earlier buckets decode while later buckets are still encoded and moving (otherwise decodes
  // start only once every bucket is posted). Each batch is still waited for exactly once.
  void RetireCompleted() {
    std::vector<Posted> left;
    for (const Posted& p : outstanding_) {
      absl::StatusOr<transport::BatchState> st = p.t->Poll(p.id);
      if (st.ok() && *st == transport::BatchState::kDone) {
        Finish(*p.route, p.t, WaitOn(p.t, p.id, ChannelOf(*p.route)));
      } else {
        left.push_back(p);
      }
    }
    outstanding_ = std::move(left);
  }

  // Waits for the outstanding batches of buckets before `bucket` (all by default), each once.
  void WaitBefore(uint32_t bucket = std::numeric_limits<uint32_t>::max()) {
    std::vector<Posted> later;
    for (const Posted& p : outstanding_) {
      if (p.route->bucket >= bucket) {
        later.push_back(p);
        continue;
      }
      Finish(*p.route, p.t, WaitOn(p.t, p.id, ChannelOf(*p.route)));
    }
    outstanding_ = std::move(later);
    if (o_.after_wait) o_.after_wait();
  }

  // Pipelining: a batch that reads nothing this version writes is posted as soon as its bucket
  // comes up; a batch that reads written regions once every batch of earlier buckets completed.
  // Per channel both nodes post in bucket order, so mirror batches never wait on each other in a
  // cycle.
  void PostPipelined(const BucketPlan& bucket, uint32_t b) {
    bool any_reads_written = false;
    for (const Route& r : bucket.routes) {
      if (r.after_deltas) continue;  // RunAfterDeltas
      if (r.reads_written) {
        any_reads_written = true;
      } else if (!Failed()) {
        Post(r);
      }
    }
    if (!any_reads_written) return;
    WaitBefore(b);
    for (const Route& r : bucket.routes) {
      if (r.reads_written && !r.after_deltas && !Failed()) Post(r);
    }
  }

  // A bucket with nccl routes: earlier buckets first, then this one as a whole. Same-node routes
  // and host channels go at once; every GPU runs the batches of its lane pairs one after another in
  // the global channel order while GPUs run in parallel (NCCL kernels of two communicators on one
  // GPU may wait on each other; with one order on every node the smallest unfinished channel always
  // has both of its GPUs at it).
  void PostNcclBucket(const BucketPlan& bucket) {
    WaitBefore();
    if (Failed()) return;
    for (const Route& r : bucket.routes) {
      if (r.kind != RouteKind::kNccl && !r.after_deltas && !Failed()) Post(r);
    }
    std::vector<std::thread> gpu_threads;
    if (!Failed()) {
      for (auto& [gpu, seq] : LaneSchedule(bucket)) {
        gpu_threads.emplace_back([this, seq = seq] {
          for (const Route* r : seq) {
            Transport* t = nullptr;
            absl::StatusOr<transport::Batch> batch = BatchOf(*r, t);
            {
              absl::MutexLock l(&mu_);
              first_post_.emplace(r->peer, absl::Now());
            }
            absl::StatusOr<transport::BatchId> id = batch.ok() ? PostOn(t, *batch, ChannelOf(*r)) : batch.status();
            absl::Status s = id.ok() ? WaitOn(t, *id, ChannelOf(*r)) : id.status();
            Finish(*r, t, s);
            if (!s.ok()) return;  // the version fails; the peer's mirrors end with the aborted version
          }
        });
      }
    }
    WaitBefore();
    for (std::thread& t : gpu_threads) t.join();
  }

  // Same-node relays out of boxes incoming deltas write (Route::after_deltas): once the delta tail
  // put every decoded or resent box in place, bucket by bucket (a relay may read what an earlier
  // one wrote). Same-node routes have no mirror on a peer: only this node waits.
  absl::Status RunAfterDeltas() {
    for (const BucketPlan& bucket : plan_.buckets) {
      bool any = false;
      for (const Route& r : bucket.routes) {
        if (r.after_deltas && !Failed()) {
          Post(r);
          any = true;
        }
      }
      if (any) WaitBefore();
    }
    absl::MutexLock l(&mu_);
    return first_.ok() ? first_ : Annotate(first_, absl::StrCat("version ", o_.version, ", relays after the deltas"));
  }

  absl::Status RunBuckets() {
    for (uint32_t b = 0; b < plan_.buckets.size() && !Failed(); ++b) {
      if (o_.before_bucket) o_.before_bucket(b);
      if (o_.aborted) {
        if (absl::Status s = o_.aborted(); !s.ok()) {
          Fail(s);
          break;
        }
      }
      // After the abort check: a version aborted while its bytes are prepared ends with the abort.
      if (o_.before_post) {
        if (absl::Status s = o_.before_post(b); !s.ok()) {
          Fail(Annotate(s, absl::StrCat("preparing bucket ", b)));
          break;
        }
      }
      if (delta_ != nullptr) {
        RetireCompleted();
        if (absl::Status s = DeltaLengths(b); !s.ok()) {
          Fail(Annotate(s, absl::StrCat("bucket ", b)));
          break;
        }
      }
      const BucketPlan& bucket = plan_.buckets[b];
      if (bucket.has_nccl) {
        PostNcclBucket(bucket);
      } else {
        PostPipelined(bucket, b);
      }
    }
    // Every posted batch is waited for (also after a failure: transports touch the memory until then).
    WaitBefore();
    absl::MutexLock l(&mu_);
    return first_.ok() ? first_ : Annotate(first_, absl::StrCat("version ", o_.version));
  }

  const ExecPlan& plan_;
  const std::map<std::string, RegionMemory>& mem_;
  const ExecTransports& t_;
  ChannelSetup& setup_;
  const ExecOptions& o_;
  ExecResult& result_;
  // Host copies of CUDA sources and GPU staging of nccl bounces: alive until the regions are released.
  std::vector<std::unique_ptr<std::vector<uint8_t>>> host_bufs_;
  std::vector<std::shared_ptr<transport::DeviceMemory>> device_bufs_;
  std::map<std::string, RegionHandle> local_h_, cuda_h_, cross_h_, nccl_h_;
  std::map<std::string, std::map<std::string, RegionHandle>> remote_h_;  // channel -> the peer's regions
  std::vector<Posted> outstanding_;  // posted, not yet waited for (post order); executor thread only
  DeltaOptions delta_options_;       // ExecOptions::deltas, decoded reports chained to on_op_landed
  std::unique_ptr<DeltaRun> delta_;  // lossless deltas of this run, or null (joins its threads first)
  std::vector<Route> fallback_;      // full resends of refused deltas (outstanding_ points into it)
  // Guards what channel-setup and GPU schedule threads share with the executor's thread.
  absl::Mutex mu_;
  std::vector<std::pair<Transport*, RegionHandle>> registered_ ABSL_GUARDED_BY(mu_);
  absl::Status first_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Time> first_post_ ABSL_GUARDED_BY(mu_);  // per peer: its first post of the version
  // Routes whose delta streams were still decoding when they completed (on_batch_done after DeltaTail).
  std::vector<std::pair<const Route*, std::string>> held_done_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status RunExecPlan(const ExecPlan& plan, const std::map<std::string, RegionMemory>& memory, const ExecTransports& transports,
                         ChannelSetup& setup, const ExecOptions& options, ExecResult& result) {
  Run run(plan, memory, transports, setup, options, result);
  return run.Go();
}

}  // namespace wb::daemon::node

#include "client/worker_client.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <random>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/grpc_retry.h"
#include "proto/grpc_status.h"
#include "base/status_macros.h"
#include "base/fd_passing.h"

namespace wb::client {
namespace {

// The daemon answers a version call with its own timeout error a little before the gRPC
// deadline fires, so callers see the daemon's message (which version, which worker) rather than
// a bare DEADLINE_EXCEEDED from the transport.
constexpr absl::Duration kDeadlineGrace = absl::Seconds(2);
// Apply: a copy into live weights that the daemon has started runs to its end (its own timeout, 2
// minutes: NodeDaemon::Options::live_copy_timeout), not to the call's timeout; the client waits for
// that answer instead of giving up while its weights are being rewritten (docs/daemon.md "Live
// weights: whole or TORN"). The call's timeout still bounds the wait for the version.
constexpr absl::Duration kLiveCopyAllowance = absl::Minutes(2);

int64_t ToMillis(absl::Duration d) {
  return d <= absl::ZeroDuration() ? 1 : absl::ToInt64Milliseconds(d);
}

struct VisitLayout {
  pb::LayoutSpec* out;
  void operator()(const ExplicitLayout& l) const {
    auto* pieces = out->mutable_pieces();
    for (const auto& p : l.pieces) *pieces->add_pieces() = p;
  }
  void operator()(const PresetLayout& l) const {
    auto* pc = out->mutable_preset();
    pc->set_preset(l.preset);
    pc->set_tp(l.tp);
    pc->set_pp(l.pp);
    pc->set_dp(l.dp);
    pc->set_ep(l.ep);
    pc->set_etp(l.etp);
    pc->set_expert_parallel(l.expert_parallel);
    pc->set_replicas(l.replicas);
    pc->set_rank(l.rank);
    pc->set_quantization(l.quantization);
    pc->set_first_stage_layers(l.first_stage_layers);
    pc->set_last_stage_layers(l.last_stage_layers);
    pc->set_vpp(l.vpp);
    pc->set_expert_placement(l.expert_placement);
    pc->set_moe_a2a_backend(l.moe_a2a_backend);
    pc->set_make_vocab_size_divisible_by(l.make_vocab_size_divisible_by);
    pc->set_moe_grouped_gemm(l.moe_grouped_gemm);
    pc->set_moe_use_legacy_grouped_gemm(l.moe_use_legacy_grouped_gemm);
    pc->set_use_tp_pp_dp_mapping(l.use_tp_pp_dp_mapping);
    pc->set_enable_dp_lm_head(l.enable_dp_lm_head);
    pc->set_moe_dense_tp_size(l.moe_dense_tp_size);
  }
  void operator()(const IndexProbeLayout& l) const {
    auto* probe = out->mutable_index_probe();
    for (const auto& t : l.tensors) *probe->add_tensors() = t;
  }
};

}  // namespace

absl::StatusOr<pb::ModelSpec> ModelSpecToProto(const ModelConfig& model) {
  if (model.model_id.empty()) return absl::InvalidArgumentError("model_id is empty");
  const bool has_config = !model.hf_config_json.empty();
  const bool has_tensors = !model.explicit_inventory.tensors.empty();
  if (has_config == has_tensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model.model_id, ": give exactly one of hf_config_json and explicit tensors"));
  }
  pb::ModelSpec spec;
  spec.set_model_id(model.model_id);
  if (has_config) {
    spec.set_hf_config_json(model.hf_config_json);
  } else {
    *spec.mutable_explicit_tensors() = ToProto(model.explicit_inventory);
  }
  spec.set_dtype(ToProto(model.dtype));
  spec.set_num_trainer_workers(model.num_trainer_workers);
  spec.set_num_rollout_workers(model.num_rollout_workers);
  spec.set_mode(ToProto(model.mode));
  spec.set_max_staleness(model.max_staleness);
  if (model.strategy == planner::Strategy::kOwnerBroadcast) {
    return absl::InvalidArgumentError("owner_broadcast is a planning baseline, not executable");
  }
  spec.set_strategy(ToProto(model.strategy));
  if (model.lora.has_value()) {
    const planner::LoraConfig& l = *model.lora;
    if (l.r < 0 || l.r > UINT32_MAX || l.max_lora_rank < 0 || l.max_lora_rank > UINT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("model ", model.model_id, ": lora.r=", l.r, " / lora.max_lora_rank=",
                                                     l.max_lora_rank, " out of range"));
    }
    pb::LoraSpec* out = spec.mutable_lora();
    for (const std::string& m : l.target_modules) out->add_target_modules(m);
    out->set_r(static_cast<uint32_t>(l.r));
    out->set_alpha(l.alpha);
    out->set_max_lora_rank(static_cast<uint32_t>(l.max_lora_rank));
    out->set_fully_sharded_loras(l.fully_sharded_loras);
  }
  return spec;
}

namespace {

// 128 random bits as 32 hex characters: two clients of one process never draw the same token.
std::string NewClientInstance() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(static_cast<uint32_t>(rd()), absl::kZeroPad8));
  return out;
}

}  // namespace

WorkerClient::WorkerClient(std::string socket_path, ClientOptions options)
    : socket_path_(std::move(socket_path)), options_(std::move(options)), client_instance_(NewClientInstance()) {}

WorkerClient::~WorkerClient() {
  // Segments unlink their names in their destructors (created here, default unlink policy).
  buffers_.clear();
  segments_.clear();
  for (auto& [key, a] : vmm_) ::close(a.fd);
}

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(const std::string& socket_path,
                                                                    ClientOptions options) {
  if (socket_path.empty()) return absl::InvalidArgumentError("empty daemon socket path");
  std::string path = socket_path;
  if (absl::StartsWith(path, "unix:")) path = path.substr(5);
  // sockaddr_un::sun_path holds 108 bytes including the terminator; gRPC fails obscurely beyond.
  if (path.size() > 107) {
    return absl::InvalidArgumentError(absl::StrCat("daemon socket path is ", path.size(),
                                                   " bytes, the Unix limit is 107: ", path));
  }
  if (options.clock == nullptr) options.clock = Clock::Real();
  std::unique_ptr<WorkerClient> client(new WorkerClient(path, std::move(options)));
  RETURN_IF_ERROR(client->OpenChannel());
  RETURN_IF_ERROR(client->WaitConnected(client->options_.clock->Now() +
                                        client->options_.connect_timeout));
  return client;
}

absl::Status WorkerClient::OpenChannel() {
  grpc::ChannelArguments args;
  // A restarted daemon should be found within a fraction of a second, not after gRPC's default
  // exponential backoff (up to two minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  // Layout descriptions of big models are tens of MB (FSDP2 over Kimi-K2: ~70k local tensors).
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  channel_ = grpc::CreateCustomChannel(absl::StrCat("unix:", socket_path_),
                                       grpc::InsecureChannelCredentials(), args);
  if (channel_ == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a channel to unix:", socket_path_));
  }
  stub_ = pb::WorkerService::NewStub(channel_);
  return absl::OkStatus();
}

absl::Status WorkerClient::WaitConnected(absl::Time deadline) {
  // WaitForConnected is driven by gRPC's own connectivity watch (no polling here).
  if (channel_->WaitForConnected(absl::ToChronoTime(deadline))) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("daemon at unix:", socket_path_, " did not accept a connection in time"));
}

pb::WorkerService::Stub* WorkerClient::stub() const { return stub_.get(); }

template <typename Fn>
absl::Status WorkerClient::CallWithReconnect(absl::Time deadline, Fn rpc) {
  if (options_.reconnect && registered_ && channel_->GetState(false) != GRPC_CHANNEL_READY) {
    // The connection dropped since the last call. gRPC would silently reconnect on this call, to
    // a daemon that may have restarted and forgotten us: reconnect explicitly and replay first.
    absl::Time reconnect_deadline =
        std::min(deadline, options_.clock->Now() + options_.reconnect_timeout);
    RETURN_IF_ERROR(WaitConnected(reconnect_deadline));
    RETURN_IF_ERROR_WITH(Replay(reconnect_deadline), "replaying registration after reconnect");
    ++reconnects_;
  }
  // Each try sent again while the daemon's server had no thread for it (proto/grpc_retry.h).
  auto call = [&] { return CallWhileServerBusy(options_.clock, deadline, [&] { return rpc(deadline); }); };
  absl::Status status = call();
  if (status.code() != absl::StatusCode::kUnavailable || !options_.reconnect) return status;
  // A daemon that is up but refuses (draining, shutting down) also answers UNAVAILABLE, over a
  // healthy connection: that is the answer, not a reason to reconnect.
  if (channel_->GetState(false) == GRPC_CHANNEL_READY) return status;
  // The daemon went away (or restarted). Wait for a daemon at the same socket, bounded by both the
  // call's deadline and the reconnect budget, replay our registrations, retry once.
  absl::Time reconnect_deadline =
      std::min(deadline, options_.clock->Now() + options_.reconnect_timeout);
  RETURN_IF_ERROR(OpenChannel());
  absl::Status connected = WaitConnected(reconnect_deadline);
  if (!connected.ok()) {
    return absl::UnavailableError(absl::StrCat(status.message(), "; reconnect failed: ",
                                               connected.message()));
  }
  RETURN_IF_ERROR_WITH(Replay(reconnect_deadline), "replaying registration after reconnect");
  ++reconnects_;
  return call();
}

absl::Status WorkerClient::Replay(absl::Time deadline) {
  if (!registered_) return absl::OkStatus();
  // A daemon that did not restart after all (a transient UNAVAILABLE) answers the replay OK: the
  // same request with this client's token is a repeat there, changing nothing. ALREADY_EXISTS is
  // no such answer any more: another client of this process holds the worker id now (it
  // registered while the daemon restarted), and replaying the layout over its registration would
  // take its memory's place.
  RETURN_IF_ERROR(DoRegisterWorker(deadline));
  // A restarted daemon has none of our VMM fds (and one that did not restart takes them again).
  RETURN_IF_ERROR(OfferVmmAllocations(deadline));
  if (layout_registered_) {
    auto resp = DoRegisterLayout(layout_request_, deadline);
    if (!resp.ok()) return resp.status();
  }
  if (resumed_) {
    // A restarted daemon counts every rollout as paused (its commits write live weights): this
    // sync rollout's engine resumed (EndUpdate), so it says so again before anything else.
    pb::EndUpdateResponse resp;
    RETURN_IF_ERROR_WITH(DoEndUpdate(deadline, deadline, &resp), "replaying EndUpdate");
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::DoEndUpdate(absl::Time until, absl::Time rpc_deadline, pb::EndUpdateResponse* resp) {
  pb::EndUpdateRequest req;
  req.set_model_id(register_request_.model_id());
  req.set_worker_id(register_request_.worker_id());
  req.set_timeout_ms(ToMillis(until - options_.clock->Now()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(rpc_deadline));
  return FromGrpcStatus(stub()->EndUpdate(&ctx, req, resp));
}

absl::Status WorkerClient::DoRegisterWorker(absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  pb::RegisterWorkerResponse resp;
  return FromGrpcStatus(stub()->RegisterWorker(&ctx, register_request_, &resp));
}

absl::StatusOr<pb::RegisterLayoutResponse> WorkerClient::DoRegisterLayout(
    const pb::RegisterLayoutRequest& req, absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  pb::RegisterLayoutResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(stub()->RegisterLayout(&ctx, req, &resp)));
  return resp;
}

absl::Status WorkerClient::RegisterWorker(const ModelConfig& model, const WorkerIdentity& who) {
  if (registered_) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", register_request_.worker_id(), " is already registered"));
  }
  if (who.worker_id.empty()) return absl::InvalidArgumentError("worker_id is empty");
  ASSIGN_OR_RETURN(pb::ModelSpec spec, ModelSpecToProto(model));
  pb::RegisterWorkerRequest req;
  req.set_model_id(model.model_id);
  req.set_worker_id(who.worker_id);
  req.set_role(ToProto(who.role));
  req.set_gpu(who.gpu);
  *req.mutable_model() = std::move(spec);
  req.set_client_instance(client_instance_);  // the same in every replay of this registration
  register_request_ = req;
  absl::Time deadline = options_.clock->Now() + options_.call_timeout;
  // Not registered yet, so a reconnect replays nothing and the retry is the registration itself.
  absl::Status s = CallWithReconnect(deadline, [&](absl::Time d) { return DoRegisterWorker(d); });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("RegisterWorker ", who.worker_id, " for model ",
                                       model.model_id));
  registered_ = true;
  // Allocations shared before a Deregister: the daemon knows them only from the process it now
  // binds to this worker id, so hand them over again.
  return OfferVmmAllocations(deadline);
}

absl::Status WorkerClient::OfferVmmAllocation(const std::string& key, absl::Time deadline) {
  const VmmAllocation& a = vmm_.at(key);
  transport::VmmFdOffer offer;
  offer.model_id = register_request_.model_id();
  offer.worker_id = register_request_.worker_id();
  offer.key = key;
  offer.allocation_bytes = a.bytes;
  offer.allocation_id = a.id;
  // The fd channel's own poll deadline runs on the real clock.
  const absl::Duration left = std::max(deadline - options_.clock->Now(), absl::Milliseconds(1));
  return Annotate(transport::OfferVmmFd(absl::StrCat(socket_path_, ".fd"), offer, a.fd, absl::Now() + left),
                  absl::StrCat("sharing CUDA VMM allocation '", key, "' of worker ", offer.worker_id));
}

absl::Status WorkerClient::OfferVmmAllocations(absl::Time deadline) {
  for (const auto& [key, a] : vmm_) RETURN_IF_ERROR(OfferVmmAllocation(key, deadline));
  return absl::OkStatus();
}

absl::Status WorkerClient::ShareCudaVmmAllocation(const std::string& key, int fd, int64_t allocation_bytes) {
  if (!registered_) {
    return absl::FailedPreconditionError(absl::StrCat("ShareCudaVmmAllocation '", key,
                                                      "' before RegisterWorker (the daemon takes fds only from registered workers)"));
  }
  if (key.empty() || key.size() > transport::kMaxVmmKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA VMM key must be 1..", transport::kMaxVmmKeyBytes, " bytes, got ", key.size()));
  }
  if (fd < 0 || allocation_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA VMM allocation '", key, "': needs an open fd and a size > 0 (fd ", fd,
                                                   ", size ", allocation_bytes, ")"));
  }
  // The daemon maps allocations by key and keeps a mapping while buffers use it: a key reused for
  // another allocation could reach the old memory.
  if (vmm_.count(key) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("CUDA VMM allocation key '", key, "' is already shared; give each allocation its own key"));
  }
  const int mine = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (mine < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA VMM allocation '", key, "': fd ", fd, ": ", std::strerror(errno)));
  }
  // Process-wide: the daemon keys offers by process, and two clients of one process may share
  // allocations under one key in turn (each its own allocation).
  static std::atomic<uint64_t> next_allocation_id{0};
  vmm_[key] = VmmAllocation{mine, allocation_bytes, ++next_allocation_id};
  absl::Status s = OfferVmmAllocation(key, options_.clock->Now() + options_.call_timeout);
  if (!s.ok()) {  // not shared: forget it
    ::close(mine);
    vmm_.erase(key);
  }
  return s;
}

absl::StatusOr<Buffer*> WorkerClient::AddCudaVmmBuffer(const std::string& key, int64_t offset_bytes, int64_t size_bytes,
                                                       int32_t gpu, std::string gpu_uuid) {
  return AddCudaVmmBuffer(std::vector<std::string>{key}, offset_bytes, size_bytes, gpu, std::move(gpu_uuid));
}

absl::StatusOr<Buffer*> WorkerClient::AddCudaVmmBuffer(const std::vector<std::string>& keys, int64_t offset_bytes,
                                                       int64_t size_bytes, int32_t gpu, std::string gpu_uuid) {
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA VMM buffer ", buffers_.size(), ": names no allocation"));
  }
  const std::string what = keys.size() == 1
                               ? absl::StrCat("CUDA VMM buffer ", buffers_.size(), " in allocation '", keys[0], "'")
                               : absl::StrCat("CUDA VMM buffer ", buffers_.size(), " over allocations '",
                                              absl::StrJoin(keys, "', '"), "'");
  std::set<std::string> seen;
  for (const std::string& key : keys) {
    if (vmm_.find(key) == vmm_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": no allocation shared under key '", key,
                                                        "' (ShareCudaVmmAllocation first)"));
    }
    if (!seen.insert(key).second) return absl::InvalidArgumentError(absl::StrCat(what, ": names allocation '", key, "' twice"));
  }
  if (offset_bytes < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": offset must be >= 0, got ", offset_bytes));
  if (size_bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": size must be > 0, got ", size_bytes));
  if (gpu < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": gpu must be >= 0, got ", gpu));
  if (!gpu_uuid.empty() && gpu_uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": gpu_uuid must be the 16 bytes of cudaDeviceProp::uuid, got ", gpu_uuid.size()));
  }
  // The range is not checked against the allocation here: the daemon checks it against the
  // allocation it maps, which is the size that counts.
  auto buf = std::make_unique<Buffer>();
  buf->id = static_cast<uint32_t>(buffers_.size());
  buf->size_bytes = size_bytes;
  buf->gpu = gpu;
  buf->gpu_uuid = std::move(gpu_uuid);
  buf->cuda_vmm_key = keys[0];
  buf->cuda_vmm_next_keys.assign(keys.begin() + 1, keys.end());
  buf->cuda_vmm_offset = offset_bytes;
  buffers_.push_back(std::move(buf));
  return buffers_.back().get();
}

absl::StatusOr<Buffer*> WorkerClient::CreateBuffer(int64_t size_bytes) {
  if (size_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("buffer size must be > 0, got ", size_bytes));
  }
  transport::ShmSegment::CreateOptions opts;
  opts.populate = options_.populate_buffers;
  ASSIGN_OR_RETURN(
      transport::ShmSegment seg,
      transport::ShmSegment::Create(transport::ShmSegment::UniqueName(options_.shm_prefix),
                                    size_bytes, opts));
  auto buf = std::make_unique<Buffer>();
  buf->id = static_cast<uint32_t>(buffers_.size());
  buf->shm_name = seg.name();
  buf->data = seg.data();
  buf->size_bytes = seg.size();
  segments_.push_back(std::move(seg));
  buffers_.push_back(std::move(buf));
  return buffers_.back().get();
}

absl::StatusOr<Buffer*> WorkerClient::AddCudaBuffer(std::string ipc_handle, int64_t size_bytes, int32_t gpu, std::string gpu_uuid) {
  const std::string what = absl::StrCat("CUDA buffer ", buffers_.size());
  if (ipc_handle.size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": IPC handle must be the 64 bytes of cudaIpcMemHandle_t, got ",
                                                   ipc_handle.size()));
  }
  if (size_bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": size must be > 0, got ", size_bytes));
  if (gpu < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": gpu must be >= 0, got ", gpu));
  if (!gpu_uuid.empty() && gpu_uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": gpu_uuid must be the 16 bytes of cudaDeviceProp::uuid, got ", gpu_uuid.size()));
  }
  auto buf = std::make_unique<Buffer>();
  buf->id = static_cast<uint32_t>(buffers_.size());
  buf->size_bytes = size_bytes;
  buf->cuda_ipc_handle = std::move(ipc_handle);
  buf->gpu = gpu;
  buf->gpu_uuid = std::move(gpu_uuid);
  buffers_.push_back(std::move(buf));
  return buffers_.back().get();
}

absl::StatusOr<LayoutInfo> WorkerClient::RegisterLayout(const LayoutSource& layout) {
  if (!registered_) return absl::FailedPreconditionError("RegisterLayout before RegisterWorker");
  pb::RegisterLayoutRequest req;
  req.set_model_id(register_request_.model_id());
  req.set_worker_id(register_request_.worker_id());
  for (const auto& b : buffers_) {
    pb::BufferSpec* spec = req.add_buffers();
    spec->set_buffer_id(b->id);
    spec->set_size_bytes(static_cast<uint64_t>(b->size_bytes));
    if (!b->cuda_vmm_key.empty()) {
      spec->set_cuda_vmm_key(b->cuda_vmm_key);
      spec->set_cuda_vmm_offset(static_cast<uint64_t>(b->cuda_vmm_offset));
      for (const std::string& k : b->cuda_vmm_next_keys) spec->add_cuda_vmm_next_keys(k);
      spec->set_gpu(b->gpu);
      spec->set_gpu_uuid(b->gpu_uuid);
    } else if (b->cuda_ipc_handle.empty()) {
      spec->set_shm_name(b->shm_name);
      spec->set_gpu(-1);
    } else {
      spec->set_cuda_ipc_handle(b->cuda_ipc_handle);
      spec->set_gpu(b->gpu);
      spec->set_gpu_uuid(b->gpu_uuid);
    }
  }
  std::visit(VisitLayout{req.mutable_layout()}, layout);
  absl::Time deadline = options_.clock->Now() + options_.call_timeout;
  pb::RegisterLayoutResponse resp;
  absl::Status s = CallWithReconnect(deadline, [&](absl::Time d) {
    auto r = DoRegisterLayout(req, d);
    if (r.ok()) resp = *r;
    return r.status();
  });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("RegisterLayout of worker ", req.worker_id()));
  layout_request_ = std::move(req);
  layout_registered_ = true;
  LayoutInfo info{resp.num_pieces(), resp.bytes(), {}};
  ASSIGN_OR_RETURN(info.layout, LayoutDescriptionFromProto(resp.layout()));
  return info;
}

const LocalTensorPlace* LayoutDescription::Find(const std::string& name) const {
  for (const LocalTensorPlace& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t LayoutDescription::BufferBytes(uint32_t id) const {
  for (const auto& [b, bytes] : buffers) {
    if (b == id) return bytes;
  }
  return 0;
}

absl::StatusOr<LayoutDescription> LayoutDescriptionFromProto(const pb::LayoutDescription& d) {
  LayoutDescription out;
  for (const pb::BufferSpec& b : d.buffers()) out.buffers.emplace_back(b.buffer_id(), static_cast<int64_t>(b.size_bytes()));
  for (const pb::LocalTensorInfo& t : d.tensors()) {
    LocalTensorPlace p;
    p.name = t.name();
    p.shape.assign(t.shape().begin(), t.shape().end());
    auto dtype = FromProto(t.dtype());
    if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat("local tensor ", t.name(), " dtype"));
    p.dtype = *dtype;
    p.buffer_id = t.buffer_id();
    p.offset_bytes = static_cast<int64_t>(t.offset_bytes());
    p.strides.assign(t.strides().begin(), t.strides().end());
    p.size_bytes = static_cast<int64_t>(t.size_bytes());
    p.pieces.assign(t.pieces().begin(), t.pieces().end());
    p.scale_tensor = t.scale_tensor();
    p.scales_of = t.scales_of();
    p.global_scale_tensor = t.global_scale_tensor();
    p.global_scale_of = t.global_scale_of();
    out.tensors.push_back(std::move(p));
  }
  out.pieces.assign(d.pieces().begin(), d.pieces().end());
  out.piece_bytes = d.piece_bytes();
  out.source = d.source();
  return out;
}

absl::StatusOr<LayoutDescription> WorkerClient::DescribeLayout(const LayoutSource& layout, const ModelConfig* model) {
  pb::DescribeLayoutRequest req;
  if (registered_) {
    req.set_model_id(register_request_.model_id());
    req.set_worker_id(register_request_.worker_id());
    req.set_role(register_request_.role());
  } else {
    if (model == nullptr) {
      return absl::FailedPreconditionError("DescribeLayout before RegisterWorker needs the model (its spec goes with the request)");
    }
    ASSIGN_OR_RETURN(*req.mutable_model(), ModelSpecToProto(*model));
    req.set_model_id(model->model_id);
  }
  std::visit(VisitLayout{req.mutable_layout()}, layout);
  pb::DescribeLayoutResponse resp;
  absl::Status s = CallWithReconnect(options_.clock->Now() + options_.call_timeout, [&](absl::Time d) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d));
    return FromGrpcStatus(stub()->DescribeLayout(&ctx, req, &resp));
  });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("DescribeLayout for model ", req.model_id()));
  return LayoutDescriptionFromProto(resp.layout());
}

absl::StatusOr<TensorView> WorkerClient::View(const LayoutDescription& layout, const std::string& name) const {
  const LocalTensorPlace* t = layout.Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("local tensor '", name, "' is not in the layout"));
  const Buffer* buf = nullptr;
  for (const auto& b : buffers_) {
    if (b->id == t->buffer_id) buf = b.get();
  }
  if (buf == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("local tensor '", name, "' lives in buffer ", t->buffer_id, ", which this client has not created"));
  }
  if (t->offset_bytes < 0 || t->size_bytes < 0 || t->offset_bytes + t->size_bytes > buf->size_bytes) {
    return absl::OutOfRangeError(absl::StrCat("local tensor '", name, "' [", t->offset_bytes, ", +", t->size_bytes, ") reaches past buffer ",
                                              t->buffer_id, " of ", buf->size_bytes, " bytes (size it as the layout says: ",
                                              layout.BufferBytes(t->buffer_id), ")"));
  }
  TensorView v;
  v.tensor = t;
  v.buffer = buf;
  v.offset_bytes = t->offset_bytes;
  if (buf->data != nullptr) v.data = static_cast<uint8_t*>(buf->data) + t->offset_bytes;
  return v;
}

absl::StatusOr<PublishResult> WorkerClient::Publish(uint64_t version, absl::Duration timeout) {
  if (version == 0) return absl::InvalidArgumentError("versions start at 1");
  const absl::Time deadline = options_.clock->Now() + timeout;
  pb::PublishResponse resp;
  absl::Status s = CallWithReconnect(deadline + kDeadlineGrace, [&](absl::Time d) {
    pb::PublishRequest req;
    req.set_model_id(register_request_.model_id());
    req.set_worker_id(register_request_.worker_id());
    req.set_version(version);
    req.set_timeout_ms(ToMillis(deadline - options_.clock->Now()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d));
    return FromGrpcStatus(stub()->Publish(&ctx, req, &resp));
  });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("Publish v", version, " by ", register_request_.worker_id()));
  return PublishResult{resp.version(), resp.stall_seconds()};
}

absl::Status WorkerClient::BeginUpdate(absl::Duration timeout) {
  const absl::Time deadline = options_.clock->Now() + timeout;
  resumed_ = false;  // paused from here on (the node marks it before anything else)
  absl::Status s = CallWithReconnect(deadline + kDeadlineGrace, [&](absl::Time d) {
    pb::BeginUpdateRequest req;
    req.set_model_id(register_request_.model_id());
    req.set_worker_id(register_request_.worker_id());
    req.set_timeout_ms(ToMillis(deadline - options_.clock->Now()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d));
    pb::BeginUpdateResponse resp;
    return FromGrpcStatus(stub()->BeginUpdate(&ctx, req, &resp));
  });
  return Annotate(s, absl::StrCat("BeginUpdate by ", register_request_.worker_id()));
}

absl::StatusOr<EndUpdateResult> WorkerClient::EndUpdate(absl::Duration timeout) {
  const absl::Time deadline = options_.clock->Now() + timeout;
  resumed_ = true;  // replayed after a reconnect (Replay), also when this call fails
  pb::EndUpdateResponse resp;
  absl::Status s = CallWithReconnect(deadline + kDeadlineGrace, [&](absl::Time d) { return DoEndUpdate(deadline, d, &resp); });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("EndUpdate by ", register_request_.worker_id()));
  return EndUpdateResult{resp.applied_version(), resp.committed_version()};
}

absl::StatusOr<ApplyResult> WorkerClient::Apply(uint64_t version, absl::Duration timeout) {
  const absl::Time deadline = options_.clock->Now() + timeout;
  pb::ApplyResponse resp;
  absl::Status s = CallWithReconnect(deadline + kDeadlineGrace, [&](absl::Time d) {
    pb::ApplyRequest req;
    req.set_model_id(register_request_.model_id());
    req.set_worker_id(register_request_.worker_id());
    req.set_version(version);
    req.set_timeout_ms(ToMillis(deadline - options_.clock->Now()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d + kLiveCopyAllowance));
    return FromGrpcStatus(stub()->Apply(&ctx, req, &resp));
  });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("Apply v", version, " by ", register_request_.worker_id()));
  return ApplyResult{resp.applied_version(), resp.stall_seconds()};
}

absl::StatusOr<uint64_t> WorkerClient::WaitVersion(uint64_t version, absl::Duration timeout) {
  const absl::Time deadline = options_.clock->Now() + timeout;
  pb::WaitVersionResponse resp;
  absl::Status s = CallWithReconnect(deadline + kDeadlineGrace, [&](absl::Time d) {
    pb::WaitVersionRequest req;
    req.set_model_id(register_request_.model_id());
    req.set_version(version);
    req.set_worker_id(register_request_.worker_id());  // a late rollout is told v once it holds it (catch-up)
    req.set_timeout_ms(ToMillis(deadline - options_.clock->Now()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d));
    return FromGrpcStatus(stub()->WaitVersion(&ctx, req, &resp));
  });
  RETURN_IF_ERROR_WITH(s, absl::StrCat("WaitVersion v", version, " of model ",
                                       register_request_.model_id()));
  return resp.committed_version();
}

absl::Status WorkerClient::Deregister() {
  if (!registered_) return absl::FailedPreconditionError("Deregister before RegisterWorker");
  pb::DeregisterRequest req;
  req.set_model_id(register_request_.model_id());
  req.set_worker_id(register_request_.worker_id());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(options_.clock->Now() + options_.call_timeout));
  pb::DeregisterResponse resp;
  // No reconnect: a daemon that restarted has already forgotten this worker.
  absl::Status s = FromGrpcStatus(stub()->Deregister(&ctx, req, &resp));
  registered_ = false;
  layout_registered_ = false;
  return Annotate(s, absl::StrCat("Deregister ", req.worker_id()));
}

absl::StatusOr<pb::StatusResponse> WorkerClient::Status() {
  pb::StatusResponse resp;
  absl::Time deadline = options_.clock->Now() + options_.call_timeout;
  absl::Status s = CallWithReconnect(deadline, [&](absl::Time d) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(d));
    return FromGrpcStatus(stub()->Status(&ctx, pb::StatusRequest(), &resp));
  });
  RETURN_IF_ERROR_WITH(s, "Status");
  return resp;
}

}  // namespace wb::client

#pragma once
// Worker-side client of a node daemon's WorkerService (gRPC over a Unix socket).
//
// A worker (a trainer or rollout rank) uses it to:
//   1. RegisterWorker: join a model (creating the model on first use),
//   2. CreateBuffer: allocate its weights in POSIX shared memory that the daemon maps (or announce
//      CUDA memory: AddCudaBuffer by IPC handle, ShareCudaVmmAllocation + AddCudaVmmBuffer for
//      cuMemCreate / expandable-segment memory),
//   3. RegisterLayout: hand the buffers' names and its layout (explicit pieces, a preset by name
//      with a parallel config and rank, or an index probe) to the daemon. DescribeLayout (any
//      time, also before RegisterWorker) tells where every local tensor lives and how large each
//      buffer must be, so the worker can size and fill its buffers first; View() gives a local
//      tensor's place (host pointer) in a registered buffer (docs/integration.md),
//   4. move versions: Publish(v) on trainers; BeginUpdate / WaitVersion (sync), Apply(v)
//      (one-step-off, async) on rollouts,
//   5. Deregister.
//
// Contract:
//  - Every call has a deadline: control calls use Options::call_timeout, the version calls take an
//    explicit timeout (which is also sent to the daemon as timeout_ms so both sides give up
//    together). Nothing waits forever.
//  - Errors are absl::Status; gRPC statuses are converted only through proto/grpc_status.h, so
//    the daemon's code (INVALID_ARGUMENT, ABORTED, DEADLINE_EXCEEDED, ...) reaches the caller.
//  - Reconnect: when the connection dropped since the previous call, or a call fails with
//    UNAVAILABLE (daemon gone or restarted), and Options::reconnect is set, the client waits
//    (bounded by Options::reconnect_timeout and the call's own deadline) for the daemon socket to
//    accept connections again, replays what it had registered (RegisterWorker, the fds of shared
//    CUDA VMM allocations, then RegisterLayout with the same shm names: the segments are owned by
//    this process and survive the daemon; EndUpdate again for a sync rollout whose last call of
//    the two was EndUpdate), and (after UNAVAILABLE) retries the call once. The daemon treats a
//    re-registration with an identical request as a repeat (OK, nothing changes). Every
//    registration carries the client's own random token (client_instance()), the same in replays:
//    another client of the same process registering a worker id this one holds is refused
//    ALREADY_EXISTS by the node, a replay of this one is not (and a replay refused ALREADY_EXISTS
//    fails: another client took the id meanwhile).
//  - Buffers created here belong to this client: their shm names are unlinked when the client is
//    destroyed. Pointers returned by CreateBuffer stay valid for the client's lifetime.
//  - Thread-compatible: one thread drives a client at a time (a worker is one rank).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/proto_convert.h"
#include "planner/model_config.h"
#include "planner/types.h"
#include "proto/weightbridge.grpc.pb.h"
#include "proto/weightbridge.pb.h"
#include "base/clock.h"
#include "base/shm_segment.h"

namespace wb::client {

struct ClientOptions {
  // Deadline of each control call (register, deregister, status).
  absl::Duration call_timeout = absl::Seconds(30);
  // How long Connect waits for the daemon socket to accept a connection.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Reconnect and replay registrations after UNAVAILABLE (see the contract above).
  bool reconnect = true;
  // Upper bound on waiting for a restarted daemon (also bounded by the failed call's deadline).
  absl::Duration reconnect_timeout = absl::Seconds(30);
  // Prefix of the shm segment names this client creates ("/wb-<prefix>-<pid>-...").
  std::string shm_prefix = "worker";
  // Pre-fault shm pages on creation (large weights: avoids page faults inside the first copy).
  bool populate_buffers = false;
  Clock* clock = Clock::Real();
};

// The model a worker joins. The first worker to register creates it; later ones must match.
struct ModelConfig {
  std::string model_id;
  // Exactly one inventory source: an HF config.json text, or explicit tensors.
  std::string hf_config_json;
  planner::Inventory explicit_inventory;
  planner::DType dtype = planner::DType::kBF16;
  uint32_t num_trainer_workers = 0;
  uint32_t num_rollout_workers = 0;
  Mode mode = Mode::kSync;
  uint32_t max_staleness = 0;  // async only; 0 = unbounded
  planner::Strategy strategy = planner::Strategy::kWeightBridge;
  // With hf_config_json: the model is these LoRA adapters alone (ModelSpec.lora, planner/lora.h).
  std::optional<planner::LoraConfig> lora;
};

struct WorkerIdentity {
  std::string worker_id;  // unique within the model, e.g. "trainer/3", "rollout/r1/0"
  planner::Role role = planner::Role::kTrainer;
  int32_t gpu = -1;  // -1: host memory worker
};

// One buffer of the worker: a shared-memory buffer owned by the client (CreateBuffer), a CUDA
// allocation of the worker announced by its IPC handle (AddCudaBuffer), or a range of a CUDA VMM
// allocation shared over the fd channel (AddCudaVmmBuffer). `id` is its buffer_id in layouts (and
// its index in planner::WorkerLayout::buffers): buffers are numbered 0, 1, ... in creation order.
struct Buffer {
  uint32_t id = 0;
  std::string shm_name;         // host buffers
  void* data = nullptr;         // host buffers: the mapping; CUDA buffers: null
  int64_t size_bytes = 0;
  std::string cuda_ipc_handle;  // CUDA buffers: the 64 bytes of cudaIpcMemHandle_t
  int32_t gpu = -1;             // CUDA buffers: the device ordinal (as this process numbers it)
  std::string gpu_uuid;         // CUDA buffers: 16 bytes of cudaDeviceProp::uuid, or empty
  std::string cuda_vmm_key;     // CUDA VMM buffers: the allocation's key (ShareCudaVmmAllocation)
  int64_t cuda_vmm_offset = 0;  // CUDA VMM buffers: the buffer's start inside that allocation
  std::vector<std::string> cuda_vmm_next_keys;  // CUDA VMM buffers over several allocations: the rest, in order
};

// Layout sources (design.md "Canonical space and layouts").
struct ExplicitLayout {
  std::vector<pb::Piece> pieces;  // tensor by HF name; see PiecesToProto for planner pieces
};
struct PresetLayout {
  std::string preset;  // megatron | fsdp (= fsdp2) | fsdp_flat (= deepspeed_zero3) | vllm | sglang (docs/presets.md)
  uint32_t tp = 1, pp = 1, dp = 1, ep = 1, etp = 0;
  bool expert_parallel = false;
  uint32_t replicas = 1;
  uint32_t rank = 0;  // this worker's rank in the preset's world
  std::string quantization;  // vllm/sglang rollouts: "", "fp8_block128" or "mxfp8" (planner/presets.h)
  // megatron: --decoder-first/last-pipeline-num-layers (0 = not set), virtual pipeline size;
  // vllm expert_parallel: "" (linear) or "round_robin". docs/presets.md.
  uint32_t first_stage_layers = 0, last_stage_layers = 0, vpp = 1;
  std::string expert_placement;
  // vllm: --all2all-backend; sglang: --moe-a2a-backend ("" = the engine's default). Decides
  // whether shared experts are whole on every rank (docs/presets.md).
  std::string moe_a2a_backend;
  // megatron: --make-vocab-size-divisible-by (0 = 128; 1 for Megatron-Bridge / verl mcore, whose
  // vocab is unpadded), --moe-grouped-gemm (TEGroupedMLP expert names), with
  // --moe-use-legacy-grouped-gemm the legacy GroupedMLP's weight1 / weight2, and
  // --use-tp-pp-dp-mapping (rank order tp-pp-dp). docs/presets.md.
  uint32_t make_vocab_size_divisible_by = 0;
  bool moe_grouped_gemm = false;
  bool moe_use_legacy_grouped_gemm = false;
  bool use_tp_pp_dp_mapping = false;
  // sglang: --enable-dp-lm-head (DP attention only: lm_head over the attention-TP group) and
  // --moe-dense-tp-size (0 = not set; 1: DeepSeek's dense MLPs whole on every rank). docs/presets.md.
  bool enable_dp_lm_head = false;
  uint32_t moe_dense_tp_size = 0;
};
struct IndexProbeLayout {
  std::vector<pb::IndexProbe::LocalTensor> tensors;
};
using LayoutSource = std::variant<ExplicitLayout, PresetLayout, IndexProbeLayout>;

// Layout discovery (WorkerService.DescribeLayout, RegisterLayoutResponse.layout; planner/layout_info.h).
// One local tensor of the worker: a preset's framework tensor (e.g.
// "decoder.layers.0.self_attention.linear_qkv.weight"), a quantised tensor's scales, or for
// explicit pieces one piece (named after its canonical tensor, plus the box when it has several).
struct LocalTensorPlace {
  std::string name;
  std::vector<int64_t> shape;           // elements (int4: unpacked elements)
  planner::DType dtype = planner::DType::kBF16;  // as stored (quantised / scale dtype included)
  uint32_t buffer_id = 0;
  int64_t offset_bytes = 0;             // of element [0, ..., 0]
  std::vector<int64_t> strides;         // elements per dim (row-major for preset tensors)
  int64_t size_bytes = 0;               // bytes spanned from offset_bytes
  std::vector<uint32_t> pieces;         // indices into LayoutDescription::pieces held here
  std::string scale_tensor;             // quantised: the tensor holding its scales
  std::string scales_of;                // scales: whose
  std::string global_scale_tensor;      // NVFP4: the tensor holding its float32 global scale ("<name>_scale_2")
  std::string global_scale_of;          // a global scale: whose
};
struct LayoutDescription {
  std::vector<std::pair<uint32_t, int64_t>> buffers;  // (buffer id, least size in bytes), the buffers it uses
  std::vector<LocalTensorPlace> tensors;               // presets: in buffer order
  std::vector<pb::Piece> pieces;                       // canonical boxes and where they land
  uint64_t piece_bytes = 0;                            // canonical bytes the pieces cover
  std::string source;                                  // "preset" | "pieces" | "index_probe"
  // The tensor named `name`, or null.
  const LocalTensorPlace* Find(const std::string& name) const;
  // The least size of buffer `id` (0: the layout does not use it).
  int64_t BufferBytes(uint32_t id) const;
};
// INVALID_ARGUMENT naming the field for an unknown dtype.
absl::StatusOr<LayoutDescription> LayoutDescriptionFromProto(const pb::LayoutDescription& d);

// A local tensor's place in one of this client's registered buffers.
struct TensorView {
  const LocalTensorPlace* tensor = nullptr;  // points into the LayoutDescription given to View()
  uint8_t* data = nullptr;  // host (shm) buffer: address of element [0, ..., 0]; CUDA buffers: null
  const Buffer* buffer = nullptr;  // the buffer (CUDA: the device address is the caller's base + offset_bytes)
  int64_t offset_bytes = 0;
};

struct LayoutInfo {
  uint32_t num_pieces = 0;
  uint64_t bytes = 0;          // bytes the pieces cover (the layout's, not the buffers' sizes)
  LayoutDescription layout;    // where every local tensor lives (empty from a daemon without discovery)
};
struct PublishResult {
  uint64_t version = 0;
  double stall_seconds = 0;
};
struct ApplyResult {
  uint64_t applied_version = 0;
  double stall_seconds = 0;
};

struct EndUpdateResult {
  uint64_t applied_version = 0;    // the version the worker's live weights hold (0: none yet)
  uint64_t committed_version = 0;  // the newest version committed for the worker on its node
};

class WorkerClient {
 public:
  // Opens a channel to the daemon's worker socket (a filesystem path; "unix:" is added) and waits
  // up to options.connect_timeout for it to connect. UNAVAILABLE if it does not.
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Connect(const std::string& socket_path,
                                                               ClientOptions options = {});

  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  // Joins `model` as `who`. Remembered for reconnects. FAILED_PRECONDITION if already registered.
  absl::Status RegisterWorker(const ModelConfig& model, const WorkerIdentity& who);

  // Creates a new zero-filled shm segment of `size_bytes` (> 0) owned by this client. Buffers are
  // sent to the daemon by the next RegisterLayout. The pointer stays valid for the client's life.
  absl::StatusOr<Buffer*> CreateBuffer(int64_t size_bytes);
  // Announces a CUDA allocation of this worker (cudaMalloc, or a caching allocator's block):
  // `ipc_handle` = the 64 bytes cudaIpcGetMemHandle returned for the allocation's BASE, `size_bytes`
  // = the bytes from the base the layout may use, `gpu` = its device ordinal, `gpu_uuid` = the 16
  // bytes of that device's cudaDeviceProp::uuid (strongly recommended: the daemon finds the GPU by
  // it when this process's CUDA_VISIBLE_DEVICES differs from the daemon's, e.g. in a container).
  // The daemon opens the handle (same node only) and, with --gpu_staging_bytes, moves versions GPU
  // to GPU. Sent by the next RegisterLayout; the worker keeps the allocation alive while
  // registered. INVALID_ARGUMENT for a handle that is not 64 bytes, a size <= 0, a negative gpu or
  // a uuid that is neither empty nor 16 bytes. No CUDA call is made here.
  absl::StatusOr<Buffer*> AddCudaBuffer(std::string ipc_handle, int64_t size_bytes, int32_t gpu, std::string gpu_uuid = "");
  // CUDA VMM memory (cuMemCreate; PyTorch's expandable_segments:True), which legacy IPC cannot
  // export: hands one allocation to the daemon. `fd` = what cuMemExportToShareableHandle(...,
  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) returned for it (it stays the caller's: the client
  // keeps a dup, to send again after a daemon restart, closed when the client goes),
  // `allocation_bytes` = the size given to cuMemCreate, `key` = this worker's name for it (1..128
  // bytes). Sent now over the daemon's fd channel (<socket>.fd, SCM_RIGHTS; gRPC cannot carry
  // descriptors), so RegisterWorker must come first: the daemon takes fds only from the process
  // bound to a registered worker. Once per allocation, however many buffers lie in it
  // (AddCudaVmmBuffer); a key names one allocation for the client's life (ALREADY_EXISTS when it
  // is shared again: the daemon maps by key). Errors carry the daemon's answer: PERMISSION_DENIED
  // or NOT_FOUND (this process is not the registered worker's), RESOURCE_EXHAUSTED (more than the
  // daemon's 1024 keys per worker), INVALID_ARGUMENT; UNAVAILABLE when no fd channel listens (a
  // daemon without one: an older build, or a worker socket path too long for "<path>.fd").
  absl::Status ShareCudaVmmAllocation(const std::string& key, int fd, int64_t allocation_bytes);
  // A buffer of `size_bytes` at `offset_bytes` inside the allocation shared under `key`; `gpu` and
  // `gpu_uuid` as in AddCudaBuffer. Sent by the next RegisterLayout; the daemon maps each
  // allocation once for all its buffers, and refuses a range that does not fit the allocation
  // (INVALID_ARGUMENT from RegisterLayout, nothing registered). Here: FAILED_PRECONDITION for a key
  // not shared by this client, INVALID_ARGUMENT for a negative offset, a size <= 0, a negative gpu
  // or a bad uuid. No CUDA call is made here.
  absl::StatusOr<Buffer*> AddCudaVmmBuffer(const std::string& key, int64_t offset_bytes, int64_t size_bytes, int32_t gpu,
                                           std::string gpu_uuid = "");
  // A buffer over SEVERAL allocations that this process mapped back to back in one address range
  // (PyTorch's expandable segments map one allocation per 2 MiB / 20 MiB page, so a large tensor
  // spans several): `keys` name them in address order, each shared by ShareCudaVmmAllocation; the
  // buffer is [offset_bytes, + size_bytes) of their concatenation, starting in keys[0]'s
  // allocation and ending in the last one's (BufferSpec.cuda_vmm_key + cuda_vmm_next_keys). The
  // daemon maps them contiguously in that order, once per key list, and refuses a range past their
  // sum or a list longer than the range (INVALID_ARGUMENT from RegisterLayout). Here:
  // FAILED_PRECONDITION naming a key not shared by this client, INVALID_ARGUMENT for no key, a key
  // twice, or the arguments AddCudaVmmBuffer refuses. One key = the overload above.
  absl::StatusOr<Buffer*> AddCudaVmmBuffer(const std::vector<std::string>& keys, int64_t offset_bytes, int64_t size_bytes,
                                           int32_t gpu, std::string gpu_uuid = "");
  const std::vector<std::unique_ptr<Buffer>>& buffers() const { return buffers_; }

  // Sends every buffer created so far and `layout`. Requires RegisterWorker. On error nothing is
  // remembered (a malformed layout leaves the previously registered one, if any, in place).
  // A preset's buffer smaller than it needs is INVALID_ARGUMENT naming worker, model, buffer and
  // both sizes. LayoutInfo::layout describes where every local tensor landed.
  absl::StatusOr<LayoutInfo> RegisterLayout(const LayoutSource& layout);

  // Layout discovery: buffer sizes and every local tensor's place for `layout` (a preset or
  // explicit pieces; an index probe is FAILED_PRECONDITION: RegisterLayout describes it), computed
  // by the node daemon without registering anything. Before RegisterWorker pass `model` (its spec
  // travels with the request); after it, the registered model is described (`model` ignored).
  // Errors keep the daemon's code: INVALID_ARGUMENT for a preset that does not fit the model,
  // NOT_FOUND for a model the node does not know and no `model` given.
  absl::StatusOr<LayoutDescription> DescribeLayout(const LayoutSource& layout, const ModelConfig* model = nullptr);
  // Where local tensor `name` of `layout` lives in this client's buffers (CreateBuffer /
  // AddCuda*Buffer, by buffer id): NOT_FOUND naming a tensor the layout lacks, FAILED_PRECONDITION
  // when its buffer does not exist here, OUT_OF_RANGE when the tensor reaches past the buffer.
  // `layout` must outlive the view.
  absl::StatusOr<TensorView> View(const LayoutDescription& layout, const std::string& name) const;

  // Trainer: declares version `version` (> 0) ready in this worker's buffers. Returns when the
  // daemon no longer needs the buffers unchanged (snapshot taken, or sync transfer done), or when
  // the staleness bound released it. The buffers must not change until it returns. CUDA buffers:
  // every write of the version must have completed on the device before the call (synchronize the
  // streams that wrote, e.g. cudaDeviceSynchronize / torch.cuda.synchronize(); a cudaMemcpy from
  // pageable memory may return before its DMA lands): the daemon reads them from another process.
  absl::StatusOr<PublishResult> Publish(uint64_t version, absl::Duration timeout);
  // Rollout (sync mode): the worker has paused and its live weights may be overwritten. A version
  // committed while it had resumed (EndUpdate) is copied into them before this returns.
  absl::Status BeginUpdate(absl::Duration timeout);
  // Rollout (sync mode): the engine resumed generating (its WaitVersion timed out or failed):
  // from now on no commit writes the live weights (a commit becomes the worker's committed copy,
  // which the next BeginUpdate or WaitVersion copies). A copy into them that is running is waited
  // for, up to `timeout`: DEADLINE_EXCEEDED when it still runs (call again before reading the
  // live weights). Returns what the live weights hold. Other modes: no effect.
  absl::StatusOr<EndUpdateResult> EndUpdate(absl::Duration timeout);
  // Rollout (one-step-off / async): make `version` (0 = newest committed) live at this step
  // boundary. Returns the version now live.
  absl::StatusOr<ApplyResult> Apply(uint64_t version, absl::Duration timeout);
  // Waits until `version` is committed; ABORTED (or the daemon's code) if it failed.
  absl::StatusOr<uint64_t> WaitVersion(uint64_t version, absl::Duration timeout);
  // Leaves the model; the client forgets its registration (buffers stay mapped until destroyed).
  absl::Status Deregister();
  // The daemon's view (nodes, workers, models, versions).
  absl::StatusOr<pb::StatusResponse> Status();

  const std::string& socket_path() const { return socket_path_; }
  // This client's random token (RegisterWorkerRequest.client_instance), drawn once per client and
  // sent with every send of its registration: the node tells this client's replays from another
  // client of the same process registering the same worker id (refused ALREADY_EXISTS while this
  // one holds it).
  const std::string& client_instance() const { return client_instance_; }
  // Number of successful reconnect-and-replay cycles (tests and progress lines read it).
  int reconnects() const { return reconnects_; }

 private:
  WorkerClient(std::string socket_path, ClientOptions options);
  absl::Status OpenChannel();
  // Waits until the channel is connected or `deadline` passes.
  absl::Status WaitConnected(absl::Time deadline);
  // Runs `rpc` (which makes one attempt with the given deadline); on UNAVAILABLE, reconnects,
  // replays registrations and retries once, all before `deadline`.
  template <typename Fn>
  absl::Status CallWithReconnect(absl::Time deadline, Fn rpc);
  absl::Status Replay(absl::Time deadline);
  // One EndUpdate RPC: timeout_ms = what is left until `until`, the RPC's own deadline
  // `rpc_deadline` (EndUpdate and Replay).
  absl::Status DoEndUpdate(absl::Time until, absl::Time rpc_deadline, pb::EndUpdateResponse* resp);
  absl::Status DoRegisterWorker(absl::Time deadline);
  absl::StatusOr<pb::RegisterLayoutResponse> DoRegisterLayout(const pb::RegisterLayoutRequest& req,
                                                              absl::Time deadline);
  pb::WorkerService::Stub* stub() const;
  // Sends every shared VMM allocation's fd again (a new daemon process, or a new registration).
  absl::Status OfferVmmAllocations(absl::Time deadline);
  absl::Status OfferVmmAllocation(const std::string& key, absl::Time deadline);

  const std::string socket_path_;
  const ClientOptions options_;
  const std::string client_instance_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::WorkerService::Stub> stub_;

  // What to replay after a reconnect.
  bool registered_ = false;
  pb::RegisterWorkerRequest register_request_;
  bool layout_registered_ = false;
  pb::RegisterLayoutRequest layout_request_;
  // Sync rollout: EndUpdate was called after the last BeginUpdate (the engine reads its live
  // weights). A restarted daemon counts the rollout as paused, so Replay sends EndUpdate again.
  bool resumed_ = false;

  // Shared VMM allocations: key -> (our dup of the fd, allocation bytes).
  struct VmmAllocation {
    int fd = -1;
    int64_t bytes = 0;
    // VmmFdOffer::allocation_id: unique in this process (a counter shared by every WorkerClient),
    // sent with every offer of this allocation, so the daemon tells a replay from another
    // allocation under a key it saw before.
    uint64_t id = 0;
  };
  std::map<std::string, VmmAllocation> vmm_;

  std::vector<transport::ShmSegment> segments_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  int reconnects_ = 0;
};

// Builds the RegisterWorker model spec (exposed for tests and for wbctl).
absl::StatusOr<pb::ModelSpec> ModelSpecToProto(const ModelConfig& model);

}  // namespace wb::client

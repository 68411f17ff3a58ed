#include "tests/e2e/worker_common.h"

#include <time.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/proto_convert.h"
#include "planner/lora.h"
#include "tests/e2e/file_wait.h"
#include "base/status_macros.h"

ABSL_FLAG(std::string, socket, "", "node daemon worker socket (path or unix:PATH)");
ABSL_FLAG(std::string, model_id, "qwen", "model id");
ABSL_FLAG(std::string, config, "", "HF config.json of the model");
ABSL_FLAG(std::string, dtype, "bfloat16", "transfer dtype: bfloat16 | float16 | float32");
ABSL_FLAG(int, num_trainers, 1, "trainer workers of the model");
ABSL_FLAG(int, num_rollouts, 1, "rollout workers of the model");
ABSL_FLAG(std::string, mode, "sync", "sync | one_step_off | async");
ABSL_FLAG(int, max_staleness, 0, "async: max versions a rollout may lag (0 = unbounded)");
ABSL_FLAG(std::string, strategy, "weightbridge", "weightbridge | rank0_broadcast | p2p_no_dedup");
ABSL_FLAG(std::string, preset, "", "megatron | fsdp (= fsdp2) | fsdp_flat | vllm | sglang");
ABSL_FLAG(int, tp, 1, "tensor parallel size");
ABSL_FLAG(int, pp, 1, "pipeline parallel size (megatron)");
ABSL_FLAG(int, dp, 1, "data parallel size (megatron, fsdp)");
ABSL_FLAG(int, ep, 1, "expert parallel size (megatron)");
ABSL_FLAG(int, etp, 0, "expert tensor parallel size (megatron; 0 = tp)");
ABSL_FLAG(bool, expert_parallel, false, "vllm/sglang expert parallel");
ABSL_FLAG(int, replicas, 1, "vllm/sglang replicas");
ABSL_FLAG(std::string, quantization, "", "vllm/sglang rollouts: \"\", fp8_block128, mxfp8, nvfp4, w4a16_g32 or w4a16_experts_g32 (planner/presets.h)");
ABSL_FLAG(int, rank, 0, "this worker's rank in the preset's world");
ABSL_FLAG(std::string, lora_targets, "",
          "comma-separated PEFT target modules: the model is these LoRA adapters alone (ModelSpec.lora; presets peft / vllm_lora)");
ABSL_FLAG(int64_t, lora_r, 8, "LoRA rank (with --lora_targets)");
ABSL_FLAG(double, lora_alpha, 16, "LoRA alpha (with --lora_targets)");
ABSL_FLAG(int64_t, lora_max_rank, 0, "vllm_lora: vLLM --max-lora-rank (0 = vLLM's default 16, or the smallest it accepts >= r)");
ABSL_FLAG(bool, lora_fully_sharded, false, "vllm_lora: vLLM --fully-sharded-loras");
ABSL_FLAG(std::string, worker_id, "", "worker id (default <role>/<rank>)");
ABSL_FLAG(int, gpu, -1, "host slot / GPU index reported to the daemon (-1 = host)");
ABSL_FLAG(bool, send_gpu_uuid, true, "--memory=cuda: send the GPU's UUID with the buffer (false: the daemon must find the GPU itself)");
ABSL_FLAG(std::string, layout_source, "preset",
          "how the layout reaches the daemon: preset (by name) | pieces (explicit)");
ABSL_FLAG(int64_t, first_version, 1, "first version");
ABSL_FLAG(double, delta_fraction, 0,
          "weights of versions in which this share of elements changes per version (lossless deltas; 0: every element)");
ABSL_FLAG(int64_t, versions, 3, "number of versions (first_version .. first_version+versions-1)");
ABSL_FLAG(int64_t, timeout_ms, 60000, "deadline of each version call");
ABSL_FLAG(int64_t, step_ms, 0, "simulated compute / generation time per step");
ABSL_FLAG(int64_t, connect_timeout_ms, 20000, "how long to wait for the daemon socket");
ABSL_FLAG(int64_t, reconnect_timeout_ms, 30000, "how long to wait for a restarted daemon");
ABSL_FLAG(bool, tolerate_failures, false,
          "a failed version is reported and the worker moves on (fault tests)");
ABSL_FLAG(std::string, gate_dir, "",
          "trainer: wait for <gate_dir>/publish-<v> before publishing v; sync rollout: for <gate_dir>/begin-<v> before "
          "BeginUpdate of v (test pacing)");
ABSL_FLAG(bool, populate, false, "pre-fault the shm buffer");
ABSL_FLAG(std::string, memory, "shm",
          "where the weights live: shm (POSIX shared memory) | cuda (cudaMalloc on --gpu, registered by CUDA IPC handle) | "
          "cuda_vmm (one cuMemCreate allocation on --gpu, or --vmm_allocations back to back, each fd sent once on the daemon's fd "
          "channel, --vmm_buffers buffers in them)");
ABSL_FLAG(int, vmm_buffers, 3, "--memory=cuda_vmm: buffers to spread the pieces over, all in the weights' range (> 1: --layout_source=pieces)");
ABSL_FLAG(int64_t, vmm_overrun_bytes, 0, "--memory=cuda_vmm fault test: declare the last buffer this many bytes past the allocation");
ABSL_FLAG(int, vmm_allocations, 1,
          "--memory=cuda_vmm: allocations mapped back to back for the weights (as an expandable segment maps one per page); "
          "buffers that cross them name every allocation they span");

namespace wb::e2e {

double MonotonicSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

void Emit(const WorkerContext& ctx, nlohmann::json event) {
  event["worker"] = ctx.worker_id;
  event["t"] = MonotonicSeconds();
  std::string line = event.dump();
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

void EmitError(const std::string& worker, const absl::Status& status) {
  nlohmann::json e = {{"event", "error"},
                      {"worker", worker},
                      {"code", absl::StatusCodeToString(status.code())},
                      {"message", std::string(status.message())},
                      {"t", MonotonicSeconds()}};
  std::fprintf(stdout, "%s\n", e.dump().c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s\n", worker.c_str(), status.ToString().c_str());
}

absl::Status PushWeights(const WorkerContext& ctx) {
  if (ctx.cuda == nullptr) return absl::OkStatus();
  return ctx.cuda->Upload(ctx.host_mirror.data());
}

bool VerifyAndReport(const WorkerContext& ctx, uint64_t version, const std::string& why) {
  double start = MonotonicSeconds();
  if (ctx.cuda != nullptr) {
    // The mirror is only a view for the checker: the bytes come from the GPU.
    absl::Status s = ctx.cuda->Download(const_cast<uint8_t*>(ctx.host_mirror.data()));
    if (!s.ok()) {
      EmitError(ctx.worker_id, s);
      return false;
    }
  }
  auto r = VerifyPieces(ctx.inventory, ctx.preset.layout, ctx.memory, version);
  if (!r.ok()) {
    EmitError(ctx.worker_id, r.status());
    return false;
  }
  if (r->mismatches > 0) {
    Emit(ctx, {{"event", "mismatch"},
               {"version", version},
               {"why", why},
               {"mismatches", r->mismatches},
               {"elements", r->elements},
               {"first", r->first_mismatch}});
    std::fprintf(stderr, "%s: %lld of %lld elements differ from v%llu (%s); first: %s\n",
                 ctx.worker_id.c_str(), static_cast<long long>(r->mismatches),
                 static_cast<long long>(r->elements), static_cast<unsigned long long>(version),
                 why.c_str(), r->first_mismatch.c_str());
    return false;
  }
  Emit(ctx, {{"event", "verified"},
             {"version", version},
             {"why", why},
             {"bytes", r->bytes},
             {"elements", r->elements},
             {"pieces", ctx.preset.layout.pieces.size()},
             {"verify_s", MonotonicSeconds() - start}});
  return true;
}

std::optional<uint64_t> VerifyOneOfAndReport(const WorkerContext& ctx, const std::vector<uint64_t>& candidates,
                                             const std::string& why) {
  if (candidates.empty()) return std::nullopt;
  if (ctx.cuda != nullptr) {
    absl::Status s = ctx.cuda->Download(const_cast<uint8_t*>(ctx.host_mirror.data()));
    if (!s.ok()) {
      EmitError(ctx.worker_id, s);
      return std::nullopt;
    }
  }
  std::optional<VerifyResult> first;
  for (uint64_t version : candidates) {
    auto r = VerifyPieces(ctx.inventory, ctx.preset.layout, ctx.memory, version);
    if (!r.ok()) {
      EmitError(ctx.worker_id, r.status());
      return std::nullopt;
    }
    if (r->mismatches == 0) {
      Emit(ctx, {{"event", "verified"}, {"version", version}, {"why", why}, {"candidates", candidates},
                 {"bytes", r->bytes}, {"elements", r->elements}, {"pieces", ctx.preset.layout.pieces.size()}});
      return version;
    }
    if (!first.has_value()) first = *r;
  }
  Emit(ctx, {{"event", "mismatch"}, {"version", candidates.front()}, {"why", why}, {"candidates", candidates},
             {"mismatches", first->mismatches}, {"elements", first->elements}, {"first", first->first_mismatch}});
  std::fprintf(stderr, "%s: live weights match none of %zu candidate versions (%s); against v%llu: %s\n", ctx.worker_id.c_str(),
               candidates.size(), why.c_str(), static_cast<unsigned long long>(candidates.front()), first->first_mismatch.c_str());
  return std::nullopt;
}

absl::Status WaitForGate(const std::string& path, absl::Duration timeout) {
  return WaitForFile(path, absl::Now() + timeout).status();
}

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<planner::DType> ParseDType(const std::string& s) {
  if (s == "bfloat16") return planner::DType::kBF16;
  if (s == "float16") return planner::DType::kF16;
  if (s == "float32") return planner::DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: unknown '", s, "'"));
}

}  // namespace

absl::StatusOr<WorkerContext> SetUpWorker(planner::Role role) {
  WorkerContext ctx;
  ctx.role = role;
  const std::string role_name = role == planner::Role::kTrainer ? "trainer" : "rollout";
  ctx.worker_id = absl::GetFlag(FLAGS_worker_id);
  if (ctx.worker_id.empty()) ctx.worker_id = absl::StrCat(role_name, "/", absl::GetFlag(FLAGS_rank));
  if (absl::GetFlag(FLAGS_socket).empty()) return absl::InvalidArgumentError("--socket is required");
  if (absl::GetFlag(FLAGS_config).empty()) return absl::InvalidArgumentError("--config is required");
  if (absl::GetFlag(FLAGS_preset).empty()) return absl::InvalidArgumentError("--preset is required");
  SetDeltaFraction(absl::GetFlag(FLAGS_delta_fraction));
  if (absl::GetFlag(FLAGS_versions) < 1 || absl::GetFlag(FLAGS_first_version) < 1) {
    return absl::InvalidArgumentError("--versions and --first_version must be >= 1");
  }
  ASSIGN_OR_RETURN(ctx.mode, client::ParseMode(absl::GetFlag(FLAGS_mode)));
  ASSIGN_OR_RETURN(planner::DType dtype, ParseDType(absl::GetFlag(FLAGS_dtype)));
  ASSIGN_OR_RETURN(planner::Strategy strategy, client::ParseStrategy(absl::GetFlag(FLAGS_strategy)));
  ctx.first_version = static_cast<uint64_t>(absl::GetFlag(FLAGS_first_version));
  ctx.last_version = ctx.first_version + static_cast<uint64_t>(absl::GetFlag(FLAGS_versions)) - 1;
  ctx.version_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  ctx.step = absl::Milliseconds(absl::GetFlag(FLAGS_step_ms));
  ctx.tolerate_failures = absl::GetFlag(FLAGS_tolerate_failures);
  ctx.gate_dir = absl::GetFlag(FLAGS_gate_dir);

  // The model and this rank's layout, computed locally exactly as the daemon computes presets.
  ASSIGN_OR_RETURN(std::string config_json, ReadFile(absl::GetFlag(FLAGS_config)));
  ASSIGN_OR_RETURN(ctx.config, planner::ParseHfConfig(config_json));
  if (!absl::GetFlag(FLAGS_lora_targets).empty()) {
    planner::LoraConfig lora;
    lora.target_modules = absl::StrSplit(absl::GetFlag(FLAGS_lora_targets), ',');
    lora.r = absl::GetFlag(FLAGS_lora_r);
    lora.alpha = absl::GetFlag(FLAGS_lora_alpha);
    lora.max_lora_rank = absl::GetFlag(FLAGS_lora_max_rank);
    lora.fully_sharded_loras = absl::GetFlag(FLAGS_lora_fully_sharded);
    ctx.config.lora = std::move(lora);
  }
  ASSIGN_OR_RETURN(ctx.inventory, planner::BuildModelInventory(ctx.config, dtype));
  planner::ParallelConfig parallel;
  parallel.preset = absl::GetFlag(FLAGS_preset);
  parallel.tp = absl::GetFlag(FLAGS_tp);
  parallel.pp = absl::GetFlag(FLAGS_pp);
  parallel.dp = absl::GetFlag(FLAGS_dp);
  parallel.ep = absl::GetFlag(FLAGS_ep);
  parallel.etp = absl::GetFlag(FLAGS_etp);
  parallel.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  parallel.replicas = absl::GetFlag(FLAGS_replicas);
  parallel.quantization = absl::GetFlag(FLAGS_quantization);
  const int rank = absl::GetFlag(FLAGS_rank);
  ASSIGN_OR_RETURN(ctx.preset, planner::MakeModelPresetLayout(ctx.config, ctx.inventory, parallel, rank));
  if (ctx.preset.layout.buffers.size() != 1) {
    return absl::InternalError(absl::StrCat("preset ", parallel.preset, " rank ", rank, " has ",
                                            ctx.preset.layout.buffers.size(),
                                            " buffers; the test workers expect one"));
  }

  client::ClientOptions options;
  options.connect_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_connect_timeout_ms));
  options.reconnect_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_reconnect_timeout_ms));
  options.shm_prefix = absl::StrCat("e2e-", role_name);
  options.populate_buffers = absl::GetFlag(FLAGS_populate);
  ASSIGN_OR_RETURN(ctx.client, client::WorkerClient::Connect(absl::GetFlag(FLAGS_socket), options));

  client::ModelConfig model;
  model.model_id = absl::GetFlag(FLAGS_model_id);
  model.hf_config_json = config_json;
  model.dtype = dtype;
  model.num_trainer_workers = static_cast<uint32_t>(absl::GetFlag(FLAGS_num_trainers));
  model.num_rollout_workers = static_cast<uint32_t>(absl::GetFlag(FLAGS_num_rollouts));
  model.mode = ctx.mode;
  model.max_staleness = static_cast<uint32_t>(absl::GetFlag(FLAGS_max_staleness));
  model.strategy = strategy;
  model.lora = ctx.config.lora;
  // Tests that change the cluster while a registration is in flight wait for this (e2e_restart_wait_test).
  Emit(ctx, {{"event", "registering"}, {"role", role_name}});
  RETURN_IF_ERROR(ctx.client->RegisterWorker(
      model, {ctx.worker_id, role, static_cast<int32_t>(absl::GetFlag(FLAGS_gpu))}));

  const std::string memory = absl::GetFlag(FLAGS_memory);
  const int64_t size = ctx.preset.layout.buffers[0].size_bytes;
  if (memory == "cuda") {
    ASSIGN_OR_RETURN(ctx.cuda, CudaWorkerBuffer::Create(absl::GetFlag(FLAGS_gpu), size));
    ctx.host_mirror.assign(static_cast<size_t>(size), 0);
    RETURN_IF_ERROR(ctx.client
                        ->AddCudaBuffer(ctx.cuda->ipc_handle(), size, absl::GetFlag(FLAGS_gpu),
                                        absl::GetFlag(FLAGS_send_gpu_uuid) ? ctx.cuda->gpu_uuid() : std::string())
                        .status());
    ctx.memory.buffers = {ctx.host_mirror.data()};
    ctx.memory.sizes = {size};
  } else if (memory == "cuda_vmm") {
    const int parts = absl::GetFlag(FLAGS_layout_source) == "pieces" ? absl::GetFlag(FLAGS_vmm_buffers) : 1;  // a preset names one buffer
    ASSIGN_OR_RETURN(VmmWeights vmm, SetUpVmmWeights(*ctx.client, ctx.inventory, ctx.preset.layout, absl::GetFlag(FLAGS_gpu),
                                                     absl::GetFlag(FLAGS_send_gpu_uuid), parts, absl::GetFlag(FLAGS_vmm_overrun_bytes),
                                                     absl::GetFlag(FLAGS_vmm_allocations)));
    ctx.preset.layout = std::move(vmm.layout);
    ctx.vmm_allocations = absl::GetFlag(FLAGS_vmm_allocations);
    ctx.vmm_spanning_buffers = vmm.spanning_buffers;
    ctx.host_mirror.assign(static_cast<size_t>(vmm.cuda->size()), 0);
    ctx.cuda = std::move(vmm.cuda);
    for (size_t j = 0; j < vmm.offsets.size(); ++j) {
      ctx.memory.buffers.push_back(ctx.host_mirror.data() + vmm.offsets[j]);
      ctx.memory.sizes.push_back(ctx.preset.layout.buffers[j].size_bytes);
    }
  } else if (memory == "shm") {
    ASSIGN_OR_RETURN(client::Buffer * buffer, ctx.client->CreateBuffer(size));
    ctx.memory.buffers = {buffer->data};
    ctx.memory.sizes = {buffer->size_bytes};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--memory: unknown '", memory, "' (shm | cuda | cuda_vmm)"));
  }

  const std::string source = absl::GetFlag(FLAGS_layout_source);
  client::LayoutInfo info;
  if (source == "preset") {
    client::PresetLayout p;
    p.preset = parallel.preset;
    p.tp = parallel.tp;
    p.pp = parallel.pp;
    p.dp = parallel.dp;
    p.ep = parallel.ep;
    p.etp = parallel.etp;
    p.expert_parallel = parallel.expert_parallel;
    p.replicas = parallel.replicas;
    p.rank = rank;
    p.quantization = parallel.quantization;
    ASSIGN_OR_RETURN(info, ctx.client->RegisterLayout(p));
  } else if (source == "pieces") {
    ASSIGN_OR_RETURN(client::pb::ExplicitPieces pieces,
                     client::PiecesToProto(ctx.preset.layout.pieces, ctx.inventory));
    client::ExplicitLayout explicit_layout;
    explicit_layout.pieces.assign(pieces.pieces().begin(), pieces.pieces().end());
    ASSIGN_OR_RETURN(info, ctx.client->RegisterLayout(explicit_layout));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--layout_source: unknown '", source, "'"));
  }
  Emit(ctx, {{"event", "ready"},
             {"role", role_name},
             {"mode", client::ModeName(ctx.mode)},
             {"pieces", info.num_pieces},
             {"bytes", info.bytes},
             {"buffer_bytes", ctx.client->buffers()[0]->size_bytes},
             {"memory", memory},
             {"buffers", ctx.client->buffers().size()},
             {"vmm_allocations", ctx.vmm_allocations},
             {"vmm_spanning_buffers", ctx.vmm_spanning_buffers},
             {"shm", ctx.client->buffers()[0]->shm_name}});
  return ctx;
}

}  // namespace wb::e2e

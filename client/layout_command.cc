#include "client/layout_command.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl_args.h"
#include "client/ctl_client.h"
#include "daemon/layout_discovery.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/grpc_status.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::client {
namespace {

namespace pb = ::weightbridge::v1;

constexpr const char* kUsage =
    "usage: wbctl layout (--config CONFIG.json | --addr unix:PATH --model ID [--config CONFIG.json])\n"
    "                    --preset P --rank R [--tp N] [--pp N] [--dp N] [--ep N] [--etp N] [--replicas N]\n"
    "                    [--expert_parallel] [--expert_placement round_robin] [--moe_a2a_backend B] [--quantization Q]\n"
    "                    [--first_stage_layers N] [--last_stage_layers N] [--vpp N] [--make_vocab_size_divisible_by N]\n"
    "                    [--moe_grouped_gemm [--moe_use_legacy_grouped_gemm]] [--use_tp_pp_dp_mapping]\n"
    "                    [--enable_dp_lm_head] [--moe_dense_tp_size N]\n"
    "                    [--dtype bfloat16] [--json] [--timeout 10s]\n";

const char* DTypeName(pb::DType d) {
  switch (d) {
    case pb::DTYPE_BF16: return "bfloat16";
    case pb::DTYPE_F16: return "float16";
    case pb::DTYPE_F32: return "float32";
    case pb::DTYPE_F8_E4M3: return "float8_e4m3";
    case pb::DTYPE_I64: return "int64";
    case pb::DTYPE_E8M0: return "float8_e8m0";
    case pb::DTYPE_I4: return "int4";
    case pb::DTYPE_F4_E2M1: return "float4_e2m1";
    default: return "?";
  }
}

absl::StatusOr<pb::DType> ParseDType(const std::string& s) {
  if (s.empty() || s == "bfloat16") return pb::DTYPE_BF16;
  if (s == "float16") return pb::DTYPE_F16;
  if (s == "float32") return pb::DTYPE_F32;
  return absl::InvalidArgumentError(absl::StrCat("--dtype '", s, "': bfloat16, float16 or float32"));
}

std::string Dims(const google::protobuf::RepeatedField<int64_t>& v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

}  // namespace

std::string LayoutTable(const pb::LayoutDescription& d, const std::string& title) {
  std::string out = absl::StrCat(title, "\n");
  for (const pb::BufferSpec& b : d.buffers()) absl::StrAppend(&out, "buffer ", b.buffer_id(), ": ", b.size_bytes(), " bytes\n");
  absl::StrAppendFormat(&out, "%7s %12s %12s %-12s %-16s %-14s %s\n", "buffer", "offset", "bytes", "dtype", "shape", "strides", "name");
  for (const pb::LocalTensorInfo& t : d.tensors()) {
    std::string name = t.name();
    if (!t.scale_tensor().empty()) absl::StrAppend(&name, "  (scales: ", t.scale_tensor(), ")");
    if (!t.global_scale_tensor().empty()) absl::StrAppend(&name, "  (global scale: ", t.global_scale_tensor(), ")");
    absl::StrAppendFormat(&out, "%7d %12d %12d %-12s %-16s %-14s %s\n", t.buffer_id(), t.offset_bytes(), t.size_bytes(), DTypeName(t.dtype()),
                          Dims(t.shape()), Dims(t.strides()), name);
  }
  absl::StrAppend(&out, d.tensors_size(), " local tensors, ", d.pieces_size(), " pieces covering ", d.piece_bytes(),
                  " bytes of the model per version\n");
  return out;
}

int RunLayoutCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  auto parsed = CtlArgs::Parse(args, {{"addr", "model", "config", "preset", "rank", "tp", "pp", "dp", "ep", "etp", "replicas",
                                       "quantization", "dtype", "timeout", "first_stage_layers", "last_stage_layers", "vpp",
                                       "expert_placement", "moe_a2a_backend", "make_vocab_size_divisible_by", "moe_dense_tp_size"},
                                      {"json", "expert_parallel", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "use_tp_pp_dp_mapping",
                                       "enable_dp_lm_head"}});
  if (!parsed.ok()) {
    err << "wbctl layout: " << parsed.status().message() << "\n" << kUsage;
    return kCtlUsage;
  }
  const CtlArgs& a = *parsed;
  auto usage = [&](const std::string& why) {
    err << "wbctl layout: " << why << "\n" << kUsage;
    return kCtlUsage;
  };
  if (a.Get("preset").empty()) return usage("--preset is required");
  if (!a.Has("addr") && !a.Has("config")) return usage("give --config CONFIG.json (offline) or --addr unix:PATH --model ID");
  if (a.Has("addr") && a.Get("model").empty()) return usage("--addr needs --model");
  pb::LayoutSpec layout;
  pb::ParallelConfig* pc = layout.mutable_preset();
  pc->set_preset(a.Get("preset"));
  pc->set_expert_parallel(a.Has("expert_parallel"));
  pc->set_quantization(a.Get("quantization"));
  pc->set_expert_placement(a.Get("expert_placement"));
  pc->set_moe_a2a_backend(a.Get("moe_a2a_backend"));
  pc->set_moe_grouped_gemm(a.Has("moe_grouped_gemm"));
  pc->set_moe_use_legacy_grouped_gemm(a.Has("moe_use_legacy_grouped_gemm"));
  pc->set_use_tp_pp_dp_mapping(a.Has("use_tp_pp_dp_mapping"));
  pc->set_enable_dp_lm_head(a.Has("enable_dp_lm_head"));  // sglang --enable-dp-lm-head
  struct UintFlag {
    const char* name;
    void (pb::ParallelConfig::*set)(uint32_t);
    uint64_t fallback;
  };
  for (const UintFlag& f : {UintFlag{"rank", &pb::ParallelConfig::set_rank, 0}, UintFlag{"tp", &pb::ParallelConfig::set_tp, 1},
                            UintFlag{"pp", &pb::ParallelConfig::set_pp, 1}, UintFlag{"dp", &pb::ParallelConfig::set_dp, 1},
                            UintFlag{"ep", &pb::ParallelConfig::set_ep, 1}, UintFlag{"etp", &pb::ParallelConfig::set_etp, 0},
                            UintFlag{"replicas", &pb::ParallelConfig::set_replicas, 1},
                            UintFlag{"first_stage_layers", &pb::ParallelConfig::set_first_stage_layers, 0},
                            UintFlag{"last_stage_layers", &pb::ParallelConfig::set_last_stage_layers, 0},
                            UintFlag{"vpp", &pb::ParallelConfig::set_vpp, 1},
                            UintFlag{"make_vocab_size_divisible_by", &pb::ParallelConfig::set_make_vocab_size_divisible_by, 0},
                            UintFlag{"moe_dense_tp_size", &pb::ParallelConfig::set_moe_dense_tp_size, 0}}) {
    auto v = a.GetUint(f.name, f.fallback);
    if (!v.ok()) return usage(std::string(v.status().message()));
    if (*v > (1u << 30)) return usage(absl::StrCat("--", f.name, " ", *v, " is too large"));
    (pc->*f.set)(static_cast<uint32_t>(*v));
  }
  auto timeout = a.GetDuration("timeout", absl::Seconds(10));
  if (!timeout.ok()) return usage(std::string(timeout.status().message()));
  auto dtype = ParseDType(a.Get("dtype"));
  if (!dtype.ok()) return usage(std::string(dtype.status().message()));

  std::optional<pb::ModelSpec> spec;
  if (a.Has("config")) {
    std::ifstream in(a.Get("config"), std::ios::binary);
    if (!in) {
      err << "wbctl layout: cannot read --config " << a.Get("config") << "\n";
      return kCtlUsage;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    spec.emplace();
    spec->set_model_id(a.Get("model", "model"));
    spec->set_hf_config_json(ss.str());
    spec->set_dtype(*dtype);
    spec->set_num_trainer_workers(1);
    spec->set_num_rollout_workers(1);
  }
  const std::string title = absl::StrCat("layout: preset ", pc->preset(), " rank ", pc->rank(), a.Has("addr") ? " from " : " of ",
                                         a.Has("addr") ? a.Get("addr") : a.Get("config"));
  pb::LayoutDescription desc;
  if (!a.Has("addr")) {
    daemon::LayoutDescriber describer;
    auto d = describer.Describe(*spec, layout, {}, std::nullopt);
    if (!d.ok()) {
      err << "wbctl layout: " << d.status() << "\n";
      return kCtlRpcFailed;
    }
    desc = std::move(*d);
  } else {
    auto addr = ParseCtlAddress(a.Get("addr"));
    if (!addr.ok()) return usage(std::string(addr.status().message()));
    if (!addr->unix_socket) return usage("--addr must be a node daemon's worker socket (unix:PATH): DescribeLayout is a WorkerService call");
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(256 << 20);  // big models' descriptions are tens of MB
    auto stub = pb::WorkerService::NewStub(grpc::CreateCustomChannel(addr->target, grpc::InsecureChannelCredentials(), channel_args));
    pb::DescribeLayoutRequest req;
    req.set_model_id(a.Get("model"));
    *req.mutable_layout() = layout;
    if (spec) *req.mutable_model() = *spec;
    pb::DescribeLayoutResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + *timeout));
    absl::Status s = FromGrpcStatus(stub->DescribeLayout(&ctx, req, &resp));
    if (!s.ok()) {
      err << "wbctl layout: " << s << "\n";
      return kCtlRpcFailed;
    }
    desc = std::move(*resp.mutable_layout());
  }
  if (a.Has("json")) {
    std::string json;
    google::protobuf::util::JsonPrintOptions o;
    o.preserve_proto_field_names = true;
    o.always_print_primitive_fields = true;
    if (!google::protobuf::util::MessageToJsonString(desc, &json, o).ok()) {
      err << "wbctl layout: cannot print JSON\n";
      return kCtlRpcFailed;
    }
    out << json << "\n";
  } else {
    out << LayoutTable(desc, title);
  }
  return kCtlOk;
}

}  // namespace wb::client

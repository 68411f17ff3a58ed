#include "daemon/coordinator/checks.h"

#include "absl/strings/escaping.h"
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

std::string EchoValue(absl::string_view value) {
  constexpr size_t kEcho = 64;
  if (value.size() <= kEcho) return absl::StrCat("'", absl::CHexEscape(value), "'");
  return absl::StrCat("'", absl::CHexEscape(value.substr(0, kEcho)), "'... (", value.size(), " bytes)");
}

absl::Status CheckName(absl::string_view field, absl::string_view value, int max_bytes, bool allow_empty) {
  if (value.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty"));
  }
  if (value.size() > static_cast<size_t>(max_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", value.size(), " bytes, more than the limit of ", max_bytes,
                                                   " (max_name_bytes): ", EchoValue(value)));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(field, " contains a control character (byte ", i, " is 0x",
                                                     absl::Hex(c, absl::kZeroPad2), "): ", EchoValue(value)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRole(absl::string_view field, int role) {
  if (role == pb::ROLE_TRAINER || role == pb::ROLE_ROLLOUT) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", role, ": must be ROLE_TRAINER (1) or ROLE_ROLLOUT (2)"));
}

absl::Status CheckMode(absl::string_view field, int mode) {
  if (pb::Mode_IsValid(mode)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", mode, ": must be MODE_SYNC (1), MODE_ONE_STEP_OFF (2), MODE_ASYNC (3) or unset (sync)"));
}

absl::Status CheckStrategy(absl::string_view field, int strategy) {
  if (pb::Strategy_IsValid(strategy)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " is ", strategy,
                                                 ": must be STRATEGY_WEIGHTBRIDGE (1), STRATEGY_RANK0_BROADCAST (2), "
                                                 "STRATEGY_P2P_NO_DEDUP (3) or unset (weightbridge)"));
}

absl::Status CheckRegisterNode(const pb::RegisterNodeRequest& req, int max_name_bytes) {
  if (absl::Status s = CheckName("RegisterNode.node_id", req.node_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("RegisterNode.address", req.address(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("RegisterNode.data_address", req.data_address(), max_name_bytes, true); !s.ok()) return s;
  if (req.transport_instances_size() > kMaxNodeTransportInstances) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterNode.transport_instances has ", req.transport_instances_size(),
                                                   " entries, more than the limit of ", kMaxNodeTransportInstances,
                                                   " (kMaxNodeTransportInstances)"));
  }
  if (req.data_nics_size() > kMaxNodeDataNics) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterNode.data_nics has ", req.data_nics_size(),
                                                   " entries, more than the limit of ", kMaxNodeDataNics, " (kMaxNodeDataNics)"));
  }
  // Sized here, not by CheckName: its message would name max_name_bytes, not this limit.
  auto entry = [](absl::string_view field, absl::string_view value, bool allow_empty) {
    if (value.size() > static_cast<size_t>(kMaxNodeEntryBytes)) {
      return absl::InvalidArgumentError(absl::StrCat(field, " is ", value.size(), " bytes, more than the limit of ",
                                                     kMaxNodeEntryBytes, " (kMaxNodeEntryBytes): ", EchoValue(value)));
    }
    return CheckName(field, value, kMaxNodeEntryBytes, allow_empty);
  };
  for (const auto& [kind, instance] : req.transport_instances()) {
    if (absl::Status s = entry("RegisterNode.transport_instances key", kind, false); !s.ok()) return s;
    if (absl::Status s = entry("RegisterNode.transport_instances value", instance, true); !s.ok()) return s;
  }
  for (const std::string& nic : req.data_nics()) {
    if (absl::Status s = entry("RegisterNode.data_nics", nic, false); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckModelSpecEnums(const pb::ModelSpec& spec, int max_name_bytes) {
  if (absl::Status s = CheckName("ModelSpec.model_id", spec.model_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckMode("ModelSpec.mode", spec.mode()); !s.ok()) return s;
  return CheckStrategy("ModelSpec.strategy", spec.strategy());
}

absl::Status CheckSameSpec(const pb::ModelSpec& have, const pb::ModelSpec& spec, absl::string_view worker, int role) {
  std::vector<std::string> diffs;
  auto number = [&](const char* field, uint64_t mine, uint64_t model) {
    if (mine != model) diffs.push_back(absl::StrCat(field, " ", mine, ", the model has ", model));
  };
  auto named = [&](const char* field, const std::string& mine, const std::string& model) {
    if (mine != model) diffs.push_back(absl::StrCat(field, " ", mine, ", the model has ", model));
  };
  auto source = [](const pb::ModelSpec& s) -> std::string {
    switch (s.inventory_case()) {
      case pb::ModelSpec::kHfConfigJson:
        return "hf_config_json";
      case pb::ModelSpec::kExplicitTensors:
        return absl::StrCat("explicit_tensors (", s.explicit_tensors().tensors_size(), " tensors)");
      default:
        return "no inventory";
    }
  };
  if (have.inventory_case() != spec.inventory_case()) {
    named("inventory", source(spec), source(have));
  } else if (spec.inventory_case() == pb::ModelSpec::kHfConfigJson && have.hf_config_json() != spec.hf_config_json()) {
    size_t at = 0;
    while (at < have.hf_config_json().size() && at < spec.hf_config_json().size() && have.hf_config_json()[at] == spec.hf_config_json()[at]) ++at;
    diffs.push_back(absl::StrCat("hf_config_json of ", spec.hf_config_json().size(), " bytes, the model has another of ", have.hf_config_json().size(),
                                 " bytes (they differ from byte ", at, ": ", EchoValue(absl::string_view(spec.hf_config_json()).substr(at, 40)),
                                 " vs ", EchoValue(absl::string_view(have.hf_config_json()).substr(at, 40)), ")"));
  } else if (spec.inventory_case() == pb::ModelSpec::kExplicitTensors &&
             have.explicit_tensors().SerializeAsString() != spec.explicit_tensors().SerializeAsString()) {
    std::string first = "their order";
    const int n = std::min(have.explicit_tensors().tensors_size(), spec.explicit_tensors().tensors_size());
    for (int i = 0; i < n; ++i) {
      if (have.explicit_tensors().tensors(i).SerializeAsString() != spec.explicit_tensors().tensors(i).SerializeAsString()) {
        first = absl::StrCat("tensor ", i, " ", EchoValue(spec.explicit_tensors().tensors(i).name()));
        break;
      }
    }
    diffs.push_back(absl::StrCat("explicit_tensors (", spec.explicit_tensors().tensors_size(), " tensors) that differ from the model's (",
                                 have.explicit_tensors().tensors_size(), " tensors) at ", first));
  }
  auto dtype = [](const pb::ModelSpec& s) { return s.dtype() == pb::DTYPE_UNSPECIFIED ? pb::DTYPE_BF16 : s.dtype(); };
  auto mode = [](const pb::ModelSpec& s) { return s.mode() == pb::MODE_UNSPECIFIED ? pb::MODE_SYNC : s.mode(); };
  auto strategy = [](const pb::ModelSpec& s) { return s.strategy() == pb::STRATEGY_UNSPECIFIED ? pb::STRATEGY_WEIGHTBRIDGE : s.strategy(); };
  if (dtype(spec) != dtype(have)) named("dtype", pb::DType_Name(dtype(spec)), pb::DType_Name(dtype(have)));
  number("num_trainer_workers", spec.num_trainer_workers(), have.num_trainer_workers());
  number("num_rollout_workers", spec.num_rollout_workers(), have.num_rollout_workers());
  if (mode(spec) != mode(have)) named("mode", pb::Mode_Name(mode(spec)), pb::Mode_Name(mode(have)));
  number("max_staleness", spec.max_staleness(), have.max_staleness());
  if (strategy(spec) != strategy(have)) named("strategy", pb::Strategy_Name(strategy(spec)), pb::Strategy_Name(strategy(have)));
  if (have.has_lora() != spec.has_lora() || have.lora().SerializeAsString() != spec.lora().SerializeAsString()) {
    auto lora = [](const pb::ModelSpec& s) {
      return s.has_lora() ? absl::StrCat("r=", s.lora().r(), ", alpha=", s.lora().alpha(), ", ", s.lora().target_modules_size(), " target modules")
                          : std::string("none");
    };
    named("LoRA adapters (ModelSpec.lora)", lora(spec), lora(have));
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::AlreadyExistsError(absl::StrCat("model ", EchoValue(have.model_id()), ": worker ", EchoValue(worker), " (",
                                               role == pb::ROLE_ROLLOUT ? "rollout" : "trainer",
                                               ") declares a spec the model does not have: ", absl::StrJoin(diffs, "; "),
                                               " (every worker of a model must declare the spec the model was created with)"));
}

absl::Status CheckJoinWorker(const pb::JoinWorkerRequest& req, int max_name_bytes) {
  if (absl::Status s = CheckName("JoinWorker.node_id", req.node_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("JoinWorker.worker_id", req.worker_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("JoinWorker.model_id", req.model_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckRole("JoinWorker.role", req.role()); !s.ok()) return s;
  // "<pid>@<start time>" from a node; stored with the worker (size probe: 10 MB was kept).
  if (absl::Status s = CheckName("JoinWorker.process", req.process(), max_name_bytes, true); !s.ok()) return s;
  if (req.has_model()) {
    if (absl::Status s = CheckName("JoinWorker.model.model_id", req.model().model_id(), max_name_bytes, true); !s.ok()) return s;
    if (absl::Status s = CheckMode("JoinWorker.model.mode", req.model().mode()); !s.ok()) return s;
    if (absl::Status s = CheckStrategy("JoinWorker.model.strategy", req.model().strategy()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon

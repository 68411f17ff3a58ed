#include "daemon/coordinator/checks.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

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
  constexpr int kMaxEntries = 1024;  // transports / lanes / NICs of one node
  if (req.transport_instances_size() > kMaxEntries || req.data_nics_size() > kMaxEntries) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterNode: ", req.transport_instances_size(), " transport_instances and ",
                                                   req.data_nics_size(), " data_nics, more than the limit of ", kMaxEntries));
  }
  for (const auto& [kind, instance] : req.transport_instances()) {
    if (absl::Status s = CheckName("RegisterNode.transport_instances key", kind, max_name_bytes); !s.ok()) return s;
    if (absl::Status s = CheckName("RegisterNode.transport_instances value", instance, max_name_bytes, true); !s.ok()) return s;
  }
  for (const std::string& nic : req.data_nics()) {
    if (absl::Status s = CheckName("RegisterNode.data_nics", nic, max_name_bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckModelSpecEnums(const pb::ModelSpec& spec, int max_name_bytes) {
  if (absl::Status s = CheckName("ModelSpec.model_id", spec.model_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckMode("ModelSpec.mode", spec.mode()); !s.ok()) return s;
  return CheckStrategy("ModelSpec.strategy", spec.strategy());
}

absl::Status CheckJoinWorker(const pb::JoinWorkerRequest& req, int max_name_bytes) {
  if (absl::Status s = CheckName("JoinWorker.node_id", req.node_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("JoinWorker.worker_id", req.worker_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckName("JoinWorker.model_id", req.model_id(), max_name_bytes); !s.ok()) return s;
  if (absl::Status s = CheckRole("JoinWorker.role", req.role()); !s.ok()) return s;
  if (req.has_model()) {
    if (absl::Status s = CheckName("JoinWorker.model.model_id", req.model().model_id(), max_name_bytes, true); !s.ok()) return s;
    if (absl::Status s = CheckMode("JoinWorker.model.mode", req.model().mode()); !s.ok()) return s;
    if (absl::Status s = CheckStrategy("JoinWorker.model.strategy", req.model().strategy()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon

#pragma once
// Input rules of the coordinator's RPCs (issue 15.12): ids, addresses and enums are checked before
// anything is stored, with INVALID_ARGUMENT naming the field; values are echoed truncated and
// escaped (a 1 MiB id or one with CR/LF must not reach a log line or an error message whole).
// Pure.

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

// At most 64 bytes of `value`, C-escaped, with "... (N bytes)" when cut.
std::string EchoValue(absl::string_view value);

// Non-empty (unless allow_empty), at most max_bytes, no control characters (< 0x20, 0x7f).
absl::Status CheckName(absl::string_view field, absl::string_view value, int max_bytes, bool allow_empty = false);

// ROLE_TRAINER or ROLE_ROLLOUT.
absl::Status CheckRole(absl::string_view field, int role);
// A Mode / Strategy value the proto defines (UNSPECIFIED = the default, allowed).
absl::Status CheckMode(absl::string_view field, int mode);
absl::Status CheckStrategy(absl::string_view field, int strategy);

// What one node may register. Every StatusResponse (ClusterStatus, each WatchStatus message)
// carries each node's transports and NICs, and the table keeps them: with 1,024 entries of 1 KiB
// each (the old bound) a node added ~2 MiB to every status, and 3 such nodes put ClusterStatus past
// a client's 4 MiB receive limit. A real node registers a few transport kinds plus one nccl lane
// ("nccl/<device>") per GPU, 16-hex-digit instance ids, and an address per NIC.
inline constexpr int kMaxNodeTransportInstances = 64;  // RegisterNodeRequest.transport_instances entries
inline constexpr int kMaxNodeDataNics = 64;            // RegisterNodeRequest.data_nics entries
inline constexpr int kMaxNodeEntryBytes = 256;         // each transport key / value and each NIC address

// RegisterNodeRequest: node_id, address, data_address (max_name_bytes), transport_instances and
// data_nics (the caps above). INVALID_ARGUMENT naming the field and the limit.
absl::Status CheckRegisterNode(const ::weightbridge::v1::RegisterNodeRequest& req, int max_name_bytes);
// JoinWorkerRequest: node_id, worker_id, model_id, role, and the model spec's enums if present.
absl::Status CheckJoinWorker(const ::weightbridge::v1::JoinWorkerRequest& req, int max_name_bytes);
// ModelSpec enums and id.
absl::Status CheckModelSpecEnums(const ::weightbridge::v1::ModelSpec& spec, int max_name_bytes);

// Worker `worker` (role `role`) joins model `have.model_id()` declaring `spec`: OK when it is the
// model's spec (unset enums count as their defaults: sync, weightbridge, bf16), else
// ALREADY_EXISTS naming the worker, the model and every differing field with both values, e.g.
// `model "m": worker rollout/3 (rollout) declares a spec the model does not have: mode
// MODE_ONE_STEP_OFF, the model has MODE_SYNC; num_rollout_workers 8, the model has 4`. Fields:
// the inventory source (hf_config_json / explicit_tensors), dtype, num_trainer_workers,
// num_rollout_workers, mode, max_staleness, strategy, lora.
absl::Status CheckSameSpec(const ::weightbridge::v1::ModelSpec& have, const ::weightbridge::v1::ModelSpec& spec, absl::string_view worker,
                           int role);

}  // namespace wb::daemon

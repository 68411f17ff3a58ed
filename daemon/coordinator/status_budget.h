#pragma once
// The ClusterStatus / WatchStatus byte budget (docs/daemon.md "Status byte budget"). A status lists
// every node with the transports and data NICs it registered (up to 64 of each, 256 bytes each:
// checks.h kMaxNode*), every worker and up to 64 version records per model; on a large cluster that
// passes the 4 MiB a gRPC client receives by default (wbctl, and a node daemon forwarding
// ClusterStatus to its workers), and the client gets nothing at all. PURE: no lock, no clock.
//
// FitStatusToBudget trims the least important repeated details first, checking the size after each
// step, and stops as soon as the status fits:
//   1. each node's transports and data_nics beyond kStatusListKeep entries;
//   2. per model, finished version records (committed, aborted, superseded) but the newest one;
//      versions still publishing, queued or transferring are kept;
//   3. free text over kStatusTextKeep bytes (version errors, catch-up errors, plan errors);
//   4. each node's transports and data_nics altogether.
// What is left out is said twice. StatusResponse.trimmed (StatusTrimmed) counts it for programs:
// the budget, the size before, nodes with lists cut, transports / data_nics entries and version
// records (total and per model) left out, texts cut, over_budget; it is set whenever the status was
// over the budget (absent: the status is whole) and its own bytes count against the budget. And in
// place, for clients built before that field: a trimmed list ends with one entry starting with
// kStatusTrimmedMarker ("(trimmed: 48 more not listed; status byte budget 3145728)"), a model whose
// version records were dropped gets one record with version 0 and state "trimmed" whose error says
// how many, and cut text ends with " ... (trimmed)". Node ids, addresses, workers and models are
// never dropped: a status whose nodes and workers alone pass the budget still passes it (the
// result says so: fits = false, and trimmed.over_budget).

#include <cstddef>

#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

inline constexpr int kStatusListKeep = 16;         // entries a node's trimmed list keeps (step 1)
inline constexpr size_t kStatusTextKeep = 256;     // bytes a cut free-text field keeps (step 3)
inline constexpr char kStatusTrimmedMarker[] = "(trimmed: ";
inline constexpr char kStatusTrimmedState[] = "trimmed";  // VersionStatus.state of the marker record

struct StatusTrim {
  size_t bytes_before = 0, bytes_after = 0;  // serialized size
  int lists_cut = 0;                         // node lists (transports, data_nics) cut, each once
  int versions_dropped = 0;                  // version records left out
  int texts_cut = 0;                         // free-text fields cut
  bool fits = true;                          // bytes_after <= budget
  // The details (entries per kind, per model) are in status->trimmed(), set when bytes_before > budget.
};

// What a filtered status (StatusRequest's filter) keeps longest: what the filter asked for.
//   kDefault:   the steps in the order above (no filter).
//   kVersions:  a model filter. Node lists go first, altogether if need be (steps 1 and 4), then
//               version records (2), then texts (3): the model's records stay whole unless they,
//               with the node ids, addresses and workers, pass the budget by themselves.
//   kNodeLists: a node filter alone. Version records (2) and texts (3) go first, then the node's
//               lists (1, then 4).
enum class StatusKeep { kDefault, kVersions, kNodeLists };

// Trims `status` to at most `budget` serialized bytes as far as the steps above allow, in the
// order `keep` picks. budget 0: no budget (nothing changes).
StatusTrim FitStatusToBudget(pb::StatusResponse* status, size_t budget, StatusKeep keep = StatusKeep::kDefault);

}  // namespace wb::daemon

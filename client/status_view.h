#pragma once
// Rendering of daemon status for wbctl (pure: no RPCs). Tables for people, JSON for scripts,
// and the progress arithmetic of `wbctl watch`.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "proto/weightbridge.pb.h"

namespace wb::client {

// Version states reported by the daemons (daemon/version_machine.cc).
bool IsFinalVersionState(const std::string& state);  // committed | aborted | superseded | applied

// `wbctl status`: nodes, workers, models (committed version, last transfer time and GB/s),
// versions. `source` names the service that answered ("coordinator", "node", ...). `filter`: what
// the status was asked for (StatusRequest: --model, --node); said in the header, and the TRIMMED
// line's pointers depend on it.
std::string StatusTable(const weightbridge::v1::StatusResponse& status, const std::string& source,
                        const weightbridge::v1::StatusRequest& filter = weightbridge::v1::StatusRequest());
nlohmann::json StatusJson(const weightbridge::v1::StatusResponse& status, const std::string& source);

// A status the coordinator trimmed to its byte budget (StatusResponse.trimmed, docs/daemon.md
// "Status byte budget"): one line starting "TRIMMED: " naming the budget and what was left out, per
// kind with counts, and where the rest is: `wbctl status --model M` / `wbctl versions --model M`
// for a model's older records and `wbctl status --node N` for a node's lists (the coordinator
// narrows a filtered status before its budget), or, when `filter` asked for that model or node
// already (it alone is over the budget), the coordinator log / the node daemon's flags. Empty for a
// whole status (no `trimmed`). StatusTable ends with it; `wbctl watch` prints it once.
std::string TrimmedLine(const weightbridge::v1::StatusResponse& status,
                        const weightbridge::v1::StatusRequest& filter = weightbridge::v1::StatusRequest());
// The same for scripts: an object with the StatusTrimmed fields (versions_dropped_by_model as an
// object); null for a whole status. StatusJson's "trimmed".
nlohmann::json TrimmedJson(const weightbridge::v1::StatusResponse& status);

// `wbctl versions --model ID`: the model's older finished version records the budget left out
// (trimmed.versions_dropped_by_model); 0 for a whole status.
uint32_t VersionsNotListed(const weightbridge::v1::StatusResponse& status, const std::string& model_id);

// A node's transports for the status table: kinds in the given order, then its nccl lanes
// ("nccl/<device>") as one item with device ranges, e.g. "host_shm,host_tcp,nccl/{0-3,6}"; "-" for none.
// With two or more `data_nics` (multi-NIC striping) host_tcp shows them: "host_tcp[10.0.0.5,10.0.1.5]".
// One worker's state in words: "no layout", "torn: <detail>", "copying v<N>", "catching up",
// "catch-up error: <why>" (a late rollout whose catch-up failed, or a source found no longer
// holding the committed version), "paused" or "ok".
std::string WorkerState(const weightbridge::v1::WorkerStatus& worker);

std::string TransportsSummary(const std::vector<std::string>& transports, const std::vector<std::string>& data_nics = {});

// `wbctl versions --model ID`: the model's versions, oldest first. Empty when the model has none.
std::vector<weightbridge::v1::VersionStatus> VersionsOf(
    const weightbridge::v1::StatusResponse& status, const std::string& model_id);
bool HasModel(const weightbridge::v1::StatusResponse& status, const std::string& model_id);
std::string VersionsTable(const std::vector<weightbridge::v1::VersionStatus>& versions);
nlohmann::json VersionsJson(const std::string& model_id,
                            const std::vector<weightbridge::v1::VersionStatus>& versions);

// `wbctl watch`: the version to follow. With `version` > 0 that version of `model_id` (any model
// when empty); otherwise the newest non-final version, or nullopt when none is running.
std::optional<weightbridge::v1::VersionStatus> PickWatched(
    const weightbridge::v1::StatusResponse& status, const std::string& model_id, uint64_t version);

// Rate and ETA from successive samples of one version.
class WatchProgress {
 public:
  struct Line {
    std::string model_id;
    uint64_t version = 0;
    std::string state;
    uint64_t bytes_done = 0;
    uint64_t bytes_total = 0;
    double rate_GBps = 0;  // over the last interval (falls back to the average)
    double eta_s = -1;     // -1 when unknown
    double seconds = 0;    // daemon-reported elapsed time of the version
    std::string error;
    bool final = false;
  };
  // Feeds one sample taken at `now`.
  Line Update(const weightbridge::v1::VersionStatus& v, absl::Time now);
  static std::string Format(const Line& line);
  static nlohmann::json ToJson(const Line& line);

 private:
  bool have_prev_ = false;
  uint64_t prev_bytes_ = 0;
  absl::Time prev_time_;
};

std::string FormatBytes(uint64_t bytes);

// `text` from a daemon (ids, version errors, torn details: a node's or worker's bytes) as a
// human-readable view may print it: control characters (C0, DEL, UTF-8 C1) escaped as \n, \r, \t or
// \xNN, so that no text can run terminal escape sequences or forge a line of the table. JSON
// output carries the text as it is (its encoder escapes it).
std::string Printable(absl::string_view text);

}  // namespace wb::client

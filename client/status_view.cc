#include "client/status_view.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace wb::client {

namespace pb = ::weightbridge::v1;

namespace {

const char* RoleName(pb::Role r) {
  return r == pb::ROLE_TRAINER ? "trainer" : r == pb::ROLE_ROLLOUT ? "rollout" : "?";
}
const char* ModeName(pb::Mode m) {
  switch (m) {
    case pb::MODE_SYNC:
      return "sync";
    case pb::MODE_ONE_STEP_OFF:
      return "one_step_off";
    case pb::MODE_ASYNC:
      return "async";
    default:
      return "?";
  }
}
const char* StrategyName(pb::Strategy s) {
  switch (s) {
    case pb::STRATEGY_RANK0_BROADCAST:
      return "rank0_broadcast";
    case pb::STRATEGY_P2P_NO_DEDUP:
      return "p2p_no_dedup";
    default:
      return "weightbridge";
  }
}

}  // namespace

std::string Printable(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    } else if (c == 0xc2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9f) {
      // A C1 control character in UTF-8 (U+0080 - U+009F; U+009B is a CSI that terminals obey).
      absl::StrAppendFormat(&out, "\\xc2\\x%02x", static_cast<unsigned char>(text[++i]));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

bool IsFinalVersionState(const std::string& state) {
  return state == "committed" || state == "aborted" || state == "superseded" || state == "applied";
}

std::string WorkerState(const pb::WorkerStatus& w) {
  if (!w.has_layout()) return "no layout";
  if (w.live_state() == "torn") {
    return absl::StrCat("torn: ", w.live_detail().empty() ? absl::StrCat("v", w.live_writing_version(), " over v", w.live_over_version())
                                                          : Printable(w.live_detail()));
  }
  if (w.live_state() == "copying") return absl::StrCat("copying v", w.live_writing_version());
  if (w.left_out()) return absl::StrCat("left out: ", Printable(w.left_out_reason()));
  if (w.catching_up()) return "catching up";
  if (!w.catch_up_error().empty()) return absl::StrCat("catch-up error: ", Printable(w.catch_up_error()));
  return w.paused() ? "paused" : "ok";
}

std::string FormatBytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.1f MB", b / 1e6);
  if (b >= 1e3) return absl::StrFormat("%.1f kB", b / 1e3);
  return absl::StrCat(bytes, " B");
}

std::string TransportsSummary(const std::vector<std::string>& transports, const std::vector<std::string>& data_nics) {
  std::vector<std::string> kinds;
  std::vector<int> lanes;
  for (const std::string& t : transports) {
    int device = -1;
    if (t.rfind("nccl/", 0) == 0 && absl::SimpleAtoi(t.substr(5), &device) && device >= 0) {
      lanes.push_back(device);
    } else if (t == "host_tcp" && !data_nics.empty()) {  // its listeners (host:port), striped over when several
      kinds.push_back(absl::StrCat(t, "[", absl::StrJoin(data_nics, ","), "]"));
    } else {
      kinds.push_back(t);
    }
  }
  std::sort(lanes.begin(), lanes.end());
  lanes.erase(std::unique(lanes.begin(), lanes.end()), lanes.end());
  if (lanes.size() == 1) {
    kinds.push_back(absl::StrCat("nccl/", lanes[0]));
  } else if (!lanes.empty()) {
    std::vector<std::string> ranges;
    for (size_t i = 0; i < lanes.size();) {
      size_t j = i;
      while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) ++j;
      ranges.push_back(j == i ? absl::StrCat(lanes[i]) : absl::StrCat(lanes[i], "-", lanes[j]));
      i = j + 1;
    }
    kinds.push_back(absl::StrCat("nccl/{", absl::StrJoin(ranges, ","), "}"));
  }
  return kinds.empty() ? "-" : absl::StrJoin(kinds, ",");
}

std::string TrimmedLine(const pb::StatusResponse& s, const pb::StatusRequest& filter) {
  if (!s.has_trimmed()) return "";
  const pb::StatusTrimmed& t = s.trimmed();
  std::string out = absl::StrCat("TRIMMED: the coordinator cut this status to its byte budget of ", t.budget_bytes(),
                                 " bytes (", t.bytes_before(), " before)");
  std::vector<std::string> left_out;
  if (t.transports_dropped() > 0) left_out.push_back(absl::StrCat(t.transports_dropped(), " transports"));
  if (t.data_nics_dropped() > 0) left_out.push_back(absl::StrCat(t.data_nics_dropped(), " data NICs"));
  if (!left_out.empty()) {
    left_out = {absl::StrCat(absl::StrJoin(left_out, " and "), " of ", t.nodes_with_lists_cut(), " nodes")};
  }
  if (t.versions_dropped() > 0) {
    std::vector<std::pair<std::string, uint32_t>> models(t.versions_dropped_by_model().begin(), t.versions_dropped_by_model().end());
    std::sort(models.begin(), models.end());  // a proto map has no order
    std::vector<std::string> per_model;
    for (const auto& [model, n] : models) per_model.push_back(absl::StrCat(model, ": ", n));
    left_out.push_back(absl::StrCat(t.versions_dropped(), " older finished version records (", absl::StrJoin(per_model, ", "), ")"));
  }
  if (!left_out.empty()) absl::StrAppend(&out, "; not listed: ", absl::StrJoin(left_out, ", "));
  if (t.texts_cut() > 0) absl::StrAppend(&out, "; ", t.texts_cut(), " long error texts cut");
  if (t.over_budget()) absl::StrAppend(&out, "; still over the budget (nodes, workers and models are never left out)");
  absl::StrAppend(&out, ". Every node, worker, model and running version is listed");
  // Where the rest is: a status narrowed to one model (or node) is narrowed before the budget, so
  // it shows what this one left out - unless this one was narrowed to it already.
  std::vector<std::string> rest;
  if (t.versions_dropped() > 0) {
    if (filter.model_id().empty()) {
      rest.push_back("a model's older versions with --model M (wbctl status --model M, wbctl versions --model M)");
    } else {
      rest.push_back(absl::StrCat("older versions of ", filter.model_id(),
                                  " (over the budget by itself) in the coordinator log (\"version committed\" / \"version aborted\")"));
    }
  }
  if (t.nodes_with_lists_cut() > 0) {
    if (filter.node_id().empty()) {
      rest.push_back("a node's full transports / NICs with --node N (wbctl status --node N)");
    } else {
      rest.push_back("the node's full transports / NICs in that node daemon's flags (--data_nics, GPU staging)");
    }
  }
  if (!rest.empty()) absl::StrAppend(&out, ". The rest: ", absl::StrJoin(rest, "; "));
  return out + "\n";
}

uint32_t VersionsNotListed(const pb::StatusResponse& s, const std::string& model_id) {
  if (!s.has_trimmed()) return 0;
  auto it = s.trimmed().versions_dropped_by_model().find(model_id);
  return it == s.trimmed().versions_dropped_by_model().end() ? 0 : it->second;
}

nlohmann::json TrimmedJson(const pb::StatusResponse& s) {
  if (!s.has_trimmed()) return nullptr;
  const pb::StatusTrimmed& t = s.trimmed();
  nlohmann::json by_model = nlohmann::json::object();
  for (const auto& [model, n] : t.versions_dropped_by_model()) by_model[model] = n;
  return {{"budget_bytes", t.budget_bytes()},
          {"bytes_before", t.bytes_before()},
          {"nodes_with_lists_cut", t.nodes_with_lists_cut()},
          {"transports_dropped", t.transports_dropped()},
          {"data_nics_dropped", t.data_nics_dropped()},
          {"versions_dropped", t.versions_dropped()},
          {"versions_dropped_by_model", by_model},
          {"texts_cut", t.texts_cut()},
          {"over_budget", t.over_budget()}};
}

std::string StatusTable(const pb::StatusResponse& s, const std::string& source, const pb::StatusRequest& filter) {
  std::string out = absl::StrFormat("daemon: %s%s%s%s (answered by the %s service)\n",
                                    s.role().empty() ? "?" : Printable(s.role()),
                                    s.node_id().empty() ? "" : " (", Printable(s.node_id()),
                                    s.node_id().empty() ? "" : ")", source);
  if (!filter.model_id().empty() || !filter.node_id().empty()) {
    std::vector<std::string> only;
    if (!filter.model_id().empty()) only.push_back(absl::StrCat("model ", filter.model_id()));
    if (!filter.node_id().empty()) only.push_back(absl::StrCat("node ", filter.node_id()));
    absl::StrAppend(&out, "filter: ", absl::StrJoin(only, ", "), " (narrowed by the daemon before its status byte budget)\n");
  }
  absl::StrAppendFormat(&out, "\nNODES (%d)\n", s.nodes_size());
  if (s.nodes_size() > 0) {
    absl::StrAppendFormat(&out, "  %-12s %-22s %-6s %-9s %-8s %-10s %s\n", "ID", "ADDRESS", "ALIVE",
                          "DRAINING", "WORKERS", "LEASE_LEFT", "TRANSPORTS");
  }
  for (const auto& n : s.nodes()) {
    absl::StrAppendFormat(&out, "  %-12s %-22s %-6s %-9s %-8d %-10s %s\n", Printable(n.node_id()), Printable(n.address()),
                          n.alive() ? "yes" : "NO",
                          n.drained() ? "drained" : n.draining() ? "yes" : "no", n.num_workers(),
                          absl::StrCat(n.lease_left_ms(), "ms"), Printable(TransportsSummary({n.transports().begin(), n.transports().end()},
                                                                                            {n.data_nics().begin(), n.data_nics().end()})));
  }
  absl::StrAppendFormat(&out, "\nWORKERS (%d)\n", s.workers_size());
  if (s.workers_size() > 0) {
    absl::StrAppendFormat(&out, "  %-20s %-12s %-8s %-12s %-8s %s\n", "ID", "MODEL", "ROLE", "NODE",
                          "APPLIED", "STATE");
  }
  for (const auto& w : s.workers()) {
    absl::StrAppendFormat(&out, "  %-20s %-12s %-8s %-12s %-8d %s\n", Printable(w.worker_id()), Printable(w.model_id()),
                          RoleName(w.role()), Printable(w.node_id()), w.applied_version(), WorkerState(w));
  }
  absl::StrAppendFormat(&out, "\nMODELS (%d)\n", s.models_size());
  if (s.models_size() > 0) {
    absl::StrAppendFormat(&out, "  %-12s %-13s %-16s %-9s %-9s %-10s %-12s %-9s %s\n", "ID", "MODE",
                          "STRATEGY", "WORKERS", "COMMITTED", "LAST_XFER", "LAST_BYTES", "GB/s",
                          "PLAN");
  }
  for (const auto& m : s.models()) {
    std::string workers = absl::StrFormat("%d/%d+%d/%d", m.registered_trainers(),
                                          m.num_trainer_workers(), m.registered_rollouts(),
                                          m.num_rollout_workers());
    std::string xfer = m.last_transfer_seconds() > 0
                           ? absl::StrFormat("%.3fs", m.last_transfer_seconds())
                           : std::string("-");
    std::string rate = m.last_transfer_gbps() > 0 ? absl::StrFormat("%.2f", m.last_transfer_gbps())
                                                  : std::string("-");
    std::string fp = Printable(m.plan_fingerprint().substr(0, 12));
    absl::StrAppendFormat(&out, "  %-12s %-13s %-16s %-9s %-9d %-10s %-12s %-9s %s%s\n",
                          Printable(m.model_id()), ModeName(m.mode()), StrategyName(m.strategy()), workers,
                          m.committed_version(), xfer, FormatBytes(m.last_transfer_bytes()), rate,
                          fp.empty() ? "-" : fp, m.draining() ? " (draining)" : "");
  }
  absl::StrAppendFormat(&out, "\nVERSIONS (%d)\n", s.versions_size());
  if (s.versions_size() > 0) out += VersionsTable({s.versions().begin(), s.versions().end()});
  if (s.has_trimmed()) out += "\n" + TrimmedLine(s, filter);
  return out;
}

nlohmann::json StatusJson(const pb::StatusResponse& s, const std::string& source) {
  nlohmann::json j;
  j["source"] = source;
  j["role"] = s.role();
  j["node_id"] = s.node_id();
  j["nodes"] = nlohmann::json::array();
  for (const auto& n : s.nodes()) {
    j["nodes"].push_back({{"node_id", n.node_id()},
                          {"address", n.address()},
                          {"data_address", n.data_address()},
                          {"alive", n.alive()},
                          {"draining", n.draining()},
                          {"drained", n.drained()},
                          {"num_workers", n.num_workers()},
                          {"lease_left_ms", n.lease_left_ms()},
                          {"transports", std::vector<std::string>(n.transports().begin(), n.transports().end())},
                          {"data_nics", std::vector<std::string>(n.data_nics().begin(), n.data_nics().end())}});
  }
  j["workers"] = nlohmann::json::array();
  for (const auto& w : s.workers()) {
    j["workers"].push_back({{"worker_id", w.worker_id()},
                            {"model_id", w.model_id()},
                            {"role", RoleName(w.role())},
                            {"node_id", w.node_id()},
                            {"applied_version", w.applied_version()},
                            {"has_layout", w.has_layout()},
                            {"paused", w.paused()},
                            {"state", WorkerState(w)},
                            {"live_state", w.live_state()},
                            {"catching_up", w.catching_up()},
                            {"catch_up_error", w.catch_up_error()},
                            {"left_out", w.left_out()},
                            {"left_out_reason", w.left_out_reason()}});
  }
  j["models"] = nlohmann::json::array();
  for (const auto& m : s.models()) {
    j["models"].push_back({{"model_id", m.model_id()},
                           {"mode", ModeName(m.mode())},
                           {"strategy", StrategyName(m.strategy())},
                           {"committed_version", m.committed_version()},
                           {"plan_fingerprint", m.plan_fingerprint()},
                           {"last_transfer_seconds", m.last_transfer_seconds()},
                           {"last_transfer_GBps", m.last_transfer_gbps()},
                           {"last_transfer_bytes", m.last_transfer_bytes()},
                           {"num_trainer_workers", m.num_trainer_workers()},
                           {"num_rollout_workers", m.num_rollout_workers()},
                           {"registered_trainers", m.registered_trainers()},
                           {"registered_rollouts", m.registered_rollouts()},
                           {"max_staleness", m.max_staleness()},
                           {"draining", m.draining()}});
  }
  j["versions"] = nlohmann::json::array();
  for (const auto& v : s.versions()) {
    j["versions"].push_back(VersionsJson(v.model_id(), {v})["versions"][0]);
  }
  j["trimmed"] = TrimmedJson(s);  // null: the status is whole
  return j;
}

std::vector<pb::VersionStatus> VersionsOf(const pb::StatusResponse& s, const std::string& model) {
  std::vector<pb::VersionStatus> out;
  for (const auto& v : s.versions()) {
    if (v.model_id() == model) out.push_back(v);
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.version() < b.version(); });
  return out;
}

bool HasModel(const pb::StatusResponse& s, const std::string& model) {
  for (const auto& m : s.models()) {
    if (m.model_id() == model) return true;
  }
  for (const auto& v : s.versions()) {
    if (v.model_id() == model) return true;
  }
  return false;
}

namespace {

// Lossless deltas of a version: "<streams>/<bytes they replaced>" ("-" when nothing travelled as a
// delta), and "+<bytes> full" for refused deltas resent in full.
std::string DeltaCell(const pb::VersionStatus& v) {
  if (v.delta_replaced_bytes() == 0 && v.delta_fallback_bytes() == 0) return "-";
  std::string out = absl::StrCat(FormatBytes(v.delta_bytes()), "/", FormatBytes(v.delta_replaced_bytes()));
  if (v.delta_fallback_bytes() > 0) absl::StrAppend(&out, " +", FormatBytes(v.delta_fallback_bytes()), " full");
  return out;
}

}  // namespace

std::string VersionsTable(const std::vector<pb::VersionStatus>& versions) {
  std::string out = absl::StrFormat("  %-12s %-8s %-13s %-22s %-9s %-8s %-9s %-24s %s\n", "MODEL", "VERSION",
                                    "STATE", "BYTES", "SECONDS", "GB/s", "VERIFIED", "DELTA", "ERROR");
  for (const auto& v : versions) {
    std::string bytes = absl::StrCat(FormatBytes(v.bytes_done()), "/", FormatBytes(v.bytes_total()));
    double rate = v.seconds() > 0 ? static_cast<double>(v.bytes_done()) / v.seconds() / 1e9 : 0;
    // End-to-end digests: "yes" = every op's landed bytes matched what its source read; "n/m" =
    // only n of the m ops carried digests (GPU paths); "-" = not decided (or digests off).
    std::string verified = v.verified() ? std::string("yes")
                           : v.ops_verified() > 0 ? absl::StrCat(v.ops_verified(), "/", v.num_ops())
                                                  : std::string("-");
    absl::StrAppendFormat(&out, "  %-12s %-8d %-13s %-22s %-9.3f %-8s %-9s %-24s %s\n", Printable(v.model_id()),
                          v.version(), Printable(v.state()), bytes, v.seconds(),
                          rate > 0 ? absl::StrFormat("%.2f", rate) : std::string("-"), verified, DeltaCell(v), Printable(v.error()));
  }
  return out;
}

nlohmann::json VersionsJson(const std::string& model_id, const std::vector<pb::VersionStatus>& versions) {
  nlohmann::json j;
  j["model_id"] = model_id;
  j["versions"] = nlohmann::json::array();
  for (const auto& v : versions) {
    j["versions"].push_back({{"model_id", v.model_id()},
                             {"version", v.version()},
                             {"state", v.state()},
                             {"bytes_total", v.bytes_total()},
                             {"bytes_done", v.bytes_done()},
                             {"seconds", v.seconds()},
                             {"num_ops", v.num_ops()},
                             {"verified", v.verified()},
                             {"ops_verified", v.ops_verified()},
                             {"delta_bytes", v.delta_bytes()},
                             {"delta_replaced_bytes", v.delta_replaced_bytes()},
                             {"delta_fallback_bytes", v.delta_fallback_bytes()},
                             {"error", v.error()}});
  }
  return j;
}

std::optional<pb::VersionStatus> PickWatched(const pb::StatusResponse& s, const std::string& model,
                                             uint64_t version) {
  std::optional<pb::VersionStatus> best;
  for (const auto& v : s.versions()) {
    if (!model.empty() && v.model_id() != model) continue;
    if (version > 0) {
      if (v.version() == version) return v;
      continue;
    }
    if (IsFinalVersionState(v.state())) continue;
    if (!best || v.version() > best->version()) best = v;
  }
  return best;
}

WatchProgress::Line WatchProgress::Update(const pb::VersionStatus& v, absl::Time now) {
  Line line;
  line.model_id = v.model_id();
  line.version = v.version();
  line.state = v.state();
  line.bytes_done = v.bytes_done();
  line.bytes_total = v.bytes_total();
  line.seconds = v.seconds();
  line.error = v.error();
  line.final = IsFinalVersionState(v.state());
  double rate = 0;  // bytes/s
  if (have_prev_ && now > prev_time_ && v.bytes_done() >= prev_bytes_) {
    rate = static_cast<double>(v.bytes_done() - prev_bytes_) / absl::ToDoubleSeconds(now - prev_time_);
  }
  if (rate <= 0 && v.seconds() > 0) rate = static_cast<double>(v.bytes_done()) / v.seconds();
  line.rate_GBps = rate / 1e9;
  if (!line.final && rate > 0 && v.bytes_total() >= v.bytes_done()) {
    line.eta_s = static_cast<double>(v.bytes_total() - v.bytes_done()) / rate;
  }
  have_prev_ = true;
  prev_bytes_ = v.bytes_done();
  prev_time_ = now;
  return line;
}

std::string WatchProgress::Format(const Line& l) {
  double pct = l.bytes_total > 0 ? 100.0 * static_cast<double>(l.bytes_done) /
                                       static_cast<double>(l.bytes_total)
                                 : 0;
  std::string out = absl::StrFormat("%s v%d %-12s %s / %s (%5.1f%%)  %.2f GB/s", Printable(l.model_id),
                                    l.version, Printable(l.state), FormatBytes(l.bytes_done),
                                    FormatBytes(l.bytes_total), pct, l.rate_GBps);
  if (l.eta_s >= 0) absl::StrAppendFormat(&out, "  ETA %.1fs", l.eta_s);
  if (l.final) absl::StrAppendFormat(&out, "  after %.3fs", l.seconds);
  if (!l.error.empty()) absl::StrAppend(&out, "  error: ", Printable(l.error));
  return out;
}

nlohmann::json WatchProgress::ToJson(const Line& l) {
  return {{"model_id", l.model_id},   {"version", l.version},         {"state", l.state},
          {"bytes_done", l.bytes_done}, {"bytes_total", l.bytes_total}, {"rate_GBps", l.rate_GBps},
          {"eta_s", l.eta_s},         {"seconds", l.seconds},         {"error", l.error},
          {"final", l.final}};
}

}  // namespace wb::client

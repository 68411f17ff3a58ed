#include "daemon/coordinator/status_budget.h"

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace wb::daemon {
namespace {

// Cuts `list`, which held `original` entries before any cut, to its first `keep` entries plus one
// marker entry saying how many are left out. False when that saves no bytes.
bool CutList(google::protobuf::RepeatedPtrField<std::string>* list, int original, int keep, size_t budget) {
  if (list->size() <= keep) return false;
  std::string marker = absl::StrCat(kStatusTrimmedMarker, original - keep, " more not listed; status byte budget ", budget, ")");
  size_t removed = 0;
  for (int i = keep; i < list->size(); ++i) removed += list->Get(i).size();
  if (removed <= marker.size()) return false;
  list->DeleteSubrange(keep, list->size() - keep);
  *list->Add() = std::move(marker);
  return true;
}

// Cuts `text` to about kStatusTextKeep bytes, on a UTF-8 character boundary (proto3 strings must
// stay valid UTF-8). False when it is short enough.
bool CutText(std::string* text) {
  static constexpr char kTail[] = " ... (trimmed)";
  if (text->size() <= kStatusTextKeep + sizeof(kTail)) return false;
  size_t end = kStatusTextKeep;
  while (end > 0 && (static_cast<unsigned char>((*text)[end]) & 0xC0) == 0x80) --end;
  text->resize(end);
  text->append(kTail);
  return true;
}

bool Finished(const std::string& state) { return state == "committed" || state == "aborted" || state == "superseded"; }

// Step 2: per model, finished records but the newest are dropped; one marker record per model says
// how many. Returns the records left out per model.
std::map<std::string, int> DropOldVersions(pb::StatusResponse* status, size_t budget) {
  std::map<std::string, uint64_t> newest_finished;  // model -> version
  for (const pb::VersionStatus& v : status->versions()) {
    if (!Finished(v.state())) continue;
    uint64_t& newest = newest_finished[v.model_id()];
    newest = std::max(newest, v.version());
  }
  std::map<std::string, int> dropped;  // model -> records left out
  google::protobuf::RepeatedPtrField<pb::VersionStatus> kept;
  for (pb::VersionStatus& v : *status->mutable_versions()) {
    if (Finished(v.state()) && v.version() != newest_finished[v.model_id()]) {
      ++dropped[v.model_id()];
      continue;
    }
    *kept.Add() = std::move(v);
  }
  for (const auto& [model, n] : dropped) {
    pb::VersionStatus* marker = kept.Add();
    marker->set_model_id(model);
    marker->set_state(kStatusTrimmedState);
    marker->set_error(absl::StrCat(n, " older finished version records not listed (status byte budget ", budget, ")"));
  }
  if (!dropped.empty()) status->mutable_versions()->Swap(&kept);
  return dropped;
}

}  // namespace

StatusTrim FitStatusToBudget(pb::StatusResponse* status, size_t budget, StatusKeep keep) {
  StatusTrim out;
  out.bytes_before = out.bytes_after = status->ByteSizeLong();
  if (budget == 0 || out.bytes_after <= budget) return out;
  struct Lists {
    int transports = 0, data_nics = 0;            // entries before any cut
    bool transports_cut = false, data_nics_cut = false;
  };
  std::vector<Lists> lists;  // per node
  for (const pb::NodeStatus& n : status->nodes()) lists.push_back({n.transports_size(), n.data_nics_size()});
  std::map<std::string, int> versions_dropped;  // per model
  // The note (StatusResponse.trimmed) is rewritten after every step, so that its own bytes count.
  auto note = [&] {
    pb::StatusTrimmed* t = status->mutable_trimmed();
    t->Clear();
    t->set_budget_bytes(budget);
    t->set_bytes_before(out.bytes_before);
    out.lists_cut = 0;
    int nodes_cut = 0;
    uint32_t transports = 0, nics = 0;
    for (int i = 0; i < status->nodes_size(); ++i) {
      const pb::NodeStatus& n = status->nodes(i);
      // A cut list holds what it kept plus its marker entry.
      if (lists[i].transports_cut) transports += static_cast<uint32_t>(lists[i].transports - (n.transports_size() - 1));
      if (lists[i].data_nics_cut) nics += static_cast<uint32_t>(lists[i].data_nics - (n.data_nics_size() - 1));
      out.lists_cut += lists[i].transports_cut + lists[i].data_nics_cut;
      nodes_cut += lists[i].transports_cut || lists[i].data_nics_cut;
    }
    t->set_nodes_with_lists_cut(static_cast<uint32_t>(nodes_cut));
    t->set_transports_dropped(transports);
    t->set_data_nics_dropped(nics);
    out.versions_dropped = 0;
    for (const auto& [model, n] : versions_dropped) {
      (*t->mutable_versions_dropped_by_model())[model] = static_cast<uint32_t>(n);
      out.versions_dropped += n;
    }
    t->set_versions_dropped(static_cast<uint32_t>(out.versions_dropped));
    t->set_texts_cut(static_cast<uint32_t>(out.texts_cut));
  };
  auto fits = [&] {
    note();
    out.bytes_after = status->ByteSizeLong();
    return out.bytes_after <= budget;
  };
  auto cut_lists = [&](int keep) {
    for (int i = 0; i < status->nodes_size(); ++i) {
      pb::NodeStatus* n = status->mutable_nodes(i);
      lists[i].transports_cut |= CutList(n->mutable_transports(), lists[i].transports, keep, budget);
      lists[i].data_nics_cut |= CutList(n->mutable_data_nics(), lists[i].data_nics, keep, budget);
    }
  };
  auto drop_versions = [&] { versions_dropped = DropOldVersions(status, budget); };
  auto cut_texts = [&] {
    for (pb::VersionStatus& v : *status->mutable_versions()) out.texts_cut += CutText(v.mutable_error());
    for (pb::WorkerStatus& w : *status->mutable_workers()) out.texts_cut += CutText(w.mutable_catch_up_error());
    for (pb::ModelStatus& m : *status->mutable_models()) out.texts_cut += CutText(m.mutable_plan_error());
  };
  std::vector<std::function<void()>> steps;
  switch (keep) {
    case StatusKeep::kDefault:
      steps = {[&] { cut_lists(kStatusListKeep); }, drop_versions, cut_texts, [&] { cut_lists(0); }};
      break;
    case StatusKeep::kVersions:
      steps = {[&] { cut_lists(kStatusListKeep); }, [&] { cut_lists(0); }, drop_versions, cut_texts};
      break;
    case StatusKeep::kNodeLists:
      steps = {drop_versions, cut_texts, [&] { cut_lists(kStatusListKeep); }, [&] { cut_lists(0); }};
      break;
  }
  for (size_t i = 0; i + 1 < steps.size(); ++i) {
    steps[i]();
    if (fits()) return out;
  }
  steps.back()();
  out.fits = fits();
  if (!out.fits) {
    status->mutable_trimmed()->set_over_budget(true);
    out.bytes_after = status->ByteSizeLong();
  }
  return out;
}

}  // namespace wb::daemon

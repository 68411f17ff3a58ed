// The ClusterStatus / WatchStatus byte budget (status_budget.h, docs/daemon.md "Status byte
// budget"): 128 nodes registered at every per-node cap used to make a status of 4.4 MiB, more
// than the 4 MiB a gRPC client receives by default (wbctl got nothing at all). Now it is trimmed
// under the budget, least important details first, says so, and still lists every node.
#include "daemon/coordinator/status_budget.h"

#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/checks.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr size_t kBudget = size_t{3} << 20;
constexpr size_t kGrpcDefaultReceive = size_t{4} << 20;

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

std::string Padded(const std::string& head, size_t bytes, char fill) { return head + std::string(bytes - head.size(), fill); }

// A coordinator (fake nodes, real clock) with `nodes` nodes registered at every cap: ids and
// addresses of max_name_bytes, kMaxNodeTransportInstances transports and kMaxNodeDataNics NICs of
// kMaxNodeEntryBytes each.
std::unique_ptr<CoordinatorCore> ClusterAtTheCaps(int nodes, int64_t max_status_bytes, std::set<std::string>* ids) {
  CoordinatorOptions o;
  o.max_status_bytes = max_status_bytes;
  o.make_node_client = [](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
    return std::make_shared<FakeNodeClient>(node);
  };
  const size_t name_bytes = static_cast<size_t>(o.max_name_bytes);
  auto core = std::make_unique<CoordinatorCore>(std::move(o));
  core->Start();
  for (int i = 0; i < nodes; ++i) {
    pb::RegisterNodeRequest req;
    req.set_node_id(Padded(absl::StrCat("n", i, "-"), name_bytes, 'x'));
    req.set_address(Padded(absl::StrCat("host", i, "-"), name_bytes - 2, 'a') + ":1");
    req.set_data_address(Padded(absl::StrCat("data", i, "-"), name_bytes - 2, 'd') + ":2");
    for (int t = 0; t < kMaxNodeTransportInstances; ++t) {
      (*req.mutable_transport_instances())[Padded(absl::StrCat("t", t, "-"), kMaxNodeEntryBytes, 'k')] = std::string(kMaxNodeEntryBytes, 'v');
    }
    for (int n = 0; n < kMaxNodeDataNics; ++n) req.add_data_nics(Padded(absl::StrCat("nic", n, "-"), kMaxNodeEntryBytes, 'c'));
    pb::RegisterNodeResponse resp;
    absl::Status s = core->RegisterNode(req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    ids->insert(req.node_id());
  }
  return core;
}

void ExpectTrimmedButComplete(const pb::StatusResponse& st, const std::set<std::string>& ids) {
  EXPECT_LE(st.ByteSizeLong(), kBudget);
  std::set<std::string> listed;
  for (const pb::NodeStatus& n : st.nodes()) {
    listed.insert(n.node_id());
    // Each list keeps its first kStatusListKeep entries, then says how many it left out.
    ASSERT_EQ(n.transports_size(), kStatusListKeep + 1) << n.node_id().substr(0, 8);
    EXPECT_TRUE(StartsWith(n.transports(kStatusListKeep), absl::StrCat(kStatusTrimmedMarker, kMaxNodeTransportInstances - kStatusListKeep, " more")))
        << n.transports(kStatusListKeep);
    ASSERT_EQ(n.data_nics_size(), kStatusListKeep + 1);
    EXPECT_TRUE(StartsWith(n.data_nics(0), "nic0-"));
    EXPECT_TRUE(StartsWith(n.data_nics(kStatusListKeep), kStatusTrimmedMarker)) << n.data_nics(kStatusListKeep);
  }
  EXPECT_EQ(listed, ids) << "every node is listed";
  // StatusResponse.trimmed counts what went: every node's two lists lost all but kStatusListKeep.
  ASSERT_TRUE(st.has_trimmed());
  const pb::StatusTrimmed& t = st.trimmed();
  EXPECT_EQ(t.budget_bytes(), kBudget);
  EXPECT_GT(t.bytes_before(), kGrpcDefaultReceive);
  EXPECT_EQ(t.nodes_with_lists_cut(), ids.size());
  EXPECT_EQ(t.transports_dropped(), ids.size() * (kMaxNodeTransportInstances - kStatusListKeep));
  EXPECT_EQ(t.data_nics_dropped(), ids.size() * (kMaxNodeDataNics - kStatusListKeep));
  EXPECT_EQ(t.versions_dropped(), 0u);
  EXPECT_TRUE(t.versions_dropped_by_model().empty());
  EXPECT_EQ(t.texts_cut(), 0u);
  EXPECT_FALSE(t.over_budget());
}

TEST(StatusBudgetTest, ALargeClusterAtTheNodeCapsFitsTheBudgetAndListsEveryNode) {
  constexpr int kNodes = 128;
  std::set<std::string> ids;
  {
    // Without a budget: the status a client would have been sent.
    std::unique_ptr<CoordinatorCore> unbounded = ClusterAtTheCaps(kNodes, 0, &ids);
    pb::StatusResponse st;
    ASSERT_TRUE(unbounded->ClusterStatus(pb::StatusRequest(), &st).ok());
    EXPECT_GT(st.ByteSizeLong(), kGrpcDefaultReceive) << "the case this test is about: more than a default client receives";
    unbounded->Shutdown();
  }
  ids.clear();
  std::unique_ptr<CoordinatorCore> core = ClusterAtTheCaps(kNodes, static_cast<int64_t>(kBudget), &ids);
  pb::StatusResponse st;
  ASSERT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
  ExpectTrimmedButComplete(st, ids);

  // WatchStatus sends the same trimmed status (its first message, at once).
  pb::StatusResponse first;
  int messages = 0;
  pb::WatchStatusRequest req;
  req.set_timeout_ms(10000);
  absl::Status ended = core->WatchStatus(
      req, [&](const pb::StatusResponse& s) { first = s; ++messages; return false; }, [] { return false; });
  EXPECT_EQ(ended.code(), absl::StatusCode::kCancelled) << ended;
  ASSERT_EQ(messages, 1);
  ExpectTrimmedButComplete(first, ids);
  core->Shutdown();
}

// A status within the budget is left exactly as it was.
TEST(StatusBudgetTest, AStatusWithinTheBudgetIsUntouched) {
  pb::StatusResponse st;
  st.set_role("coordinator");
  pb::NodeStatus* n = st.add_nodes();
  n->set_node_id("n0");
  for (int i = 0; i < 40; ++i) n->add_transports(absl::StrCat("nccl/", i));
  for (int v = 1; v <= 64; ++v) {
    pb::VersionStatus* vs = st.add_versions();
    vs->set_model_id("m");
    vs->set_version(v);
    vs->set_state("committed");
  }
  const std::string before = st.SerializeAsString();
  const StatusTrim trim = FitStatusToBudget(&st, before.size());
  EXPECT_EQ(st.SerializeAsString(), before);
  EXPECT_FALSE(st.has_trimmed()) << "a whole status has no trimmed note";
  EXPECT_TRUE(trim.fits);
  EXPECT_EQ(trim.lists_cut + trim.versions_dropped + trim.texts_cut, 0);
  EXPECT_EQ(FitStatusToBudget(&st, 0).bytes_after, before.size()) << "budget 0: no budget";
}

// Old finished version records go after node lists: versions still running and the newest finished
// one of each model stay, and a record with state "trimmed" says how many went. Then long texts
// are cut (valid UTF-8), then whole node lists.
TEST(StatusBudgetTest, OldVersionRecordsThenLongTextsThenWholeListsGo) {
  pb::StatusResponse st;
  pb::NodeStatus* n = st.add_nodes();
  n->set_node_id("n0");
  for (int i = 0; i < 20; ++i) n->add_data_nics(Padded(absl::StrCat("nic", i, "-"), 200, 'c'));
  for (const char* model : {"a", "b"}) {
    for (int v = 1; v <= 64; ++v) {
      pb::VersionStatus* vs = st.add_versions();
      vs->set_model_id(model);
      vs->set_version(v);
      vs->set_state(v == 64 ? "transferring" : v % 7 == 0 ? "aborted" : "committed");
      vs->set_error(std::string(2000, 'e'));
    }
  }
  pb::ModelStatus* m = st.add_models();
  m->set_model_id("a");
  std::string plan_error;
  for (int i = 0; i < 400; ++i) plan_error += "\xc3\xa9";  // "é": two bytes each
  m->set_plan_error(plan_error);
  const size_t full = st.ByteSizeLong();

  // Room for a little more than the lists cut to kStatusListKeep: versions must go too.
  pb::StatusResponse trimmed = st;
  StatusTrim trim = FitStatusToBudget(&trimmed, full / 4);
  EXPECT_TRUE(trim.fits) << trim.bytes_after;
  EXPECT_EQ(trim.lists_cut, 1);
  EXPECT_EQ(trim.versions_dropped, 2 * 62);
  EXPECT_EQ(trim.texts_cut, 0) << "not needed";
  std::set<std::pair<std::string, uint64_t>> kept;
  for (const pb::VersionStatus& vs : trimmed.versions()) {
    if (vs.state() == kStatusTrimmedState) {
      EXPECT_EQ(vs.version(), 0u);
      EXPECT_TRUE(StartsWith(vs.error(), "62 older finished version records not listed")) << vs.error();
      continue;
    }
    kept.insert({vs.model_id(), vs.version()});
  }
  EXPECT_EQ(kept, (std::set<std::pair<std::string, uint64_t>>{{"a", 63}, {"a", 64}, {"b", 63}, {"b", 64}}));
  // The note's counts are what went: 4 of node n0's 20 NICs, per model the 62 records not kept.
  ASSERT_TRUE(trimmed.has_trimmed());
  const pb::StatusTrimmed& t = trimmed.trimmed();
  EXPECT_EQ(t.budget_bytes(), full / 4);
  EXPECT_EQ(t.bytes_before(), full);
  EXPECT_EQ(t.nodes_with_lists_cut(), 1u);
  EXPECT_EQ(t.transports_dropped(), 0u);
  EXPECT_EQ(t.data_nics_dropped(), 20u - kStatusListKeep);
  EXPECT_EQ(t.versions_dropped(), static_cast<uint32_t>(st.versions_size()) - kept.size());
  EXPECT_EQ(t.versions_dropped_by_model().size(), 2u);
  EXPECT_EQ(t.versions_dropped_by_model().at("a"), 62u);
  EXPECT_EQ(t.versions_dropped_by_model().at("b"), 62u);
  EXPECT_EQ(t.texts_cut(), 0u);
  EXPECT_FALSE(t.over_budget());

  // Tighter: long texts are cut, on a character boundary, and then the node's list goes
  // altogether (its marker counts all 20); the node stays.
  trimmed = st;
  trim = FitStatusToBudget(&trimmed, 4000);
  EXPECT_TRUE(trim.fits) << trim.bytes_after;
  EXPECT_EQ(trim.texts_cut, 5) << "4 version errors and the plan error";
  const std::string& cut = trimmed.models(0).plan_error();
  EXPECT_LE(cut.size(), kStatusTextKeep + 20);
  EXPECT_NE(cut.find(" ... (trimmed)"), std::string::npos);
  EXPECT_EQ(cut.substr(0, cut.find(" ...")).size() % 2, 0u) << "a two-byte character was split";
  pb::StatusResponse reparsed;
  EXPECT_TRUE(reparsed.ParseFromString(trimmed.SerializeAsString())) << "still valid UTF-8";
  ASSERT_EQ(trimmed.nodes_size(), 1);
  ASSERT_EQ(trimmed.nodes(0).data_nics_size(), 1);
  EXPECT_TRUE(StartsWith(trimmed.nodes(0).data_nics(0), absl::StrCat(kStatusTrimmedMarker, "20 more"))) << trimmed.nodes(0).data_nics(0);
  // The list cut twice counts once, with all its 20 entries; the note's bytes are within the budget.
  EXPECT_EQ(trim.lists_cut, 1);
  EXPECT_EQ(trimmed.trimmed().nodes_with_lists_cut(), 1u);
  EXPECT_EQ(trimmed.trimmed().data_nics_dropped(), 20u);
  EXPECT_EQ(trimmed.trimmed().versions_dropped(), 2u * 62);
  EXPECT_EQ(trimmed.trimmed().texts_cut(), 5u);
  EXPECT_FALSE(trimmed.trimmed().over_budget());
  EXPECT_LE(trimmed.ByteSizeLong(), 4000u);
}

// A filtered status keeps what the filter asked for longest (StatusKeep): a model filter cuts node
// lists altogether before any version record; a node filter drops version records and texts before
// the node's lists.
TEST(StatusBudgetTest, AFilteredStatusKeepsWhatTheFilterAskedForLongest) {
  pb::StatusResponse st;
  pb::NodeStatus* n = st.add_nodes();
  n->set_node_id("n0");
  for (int i = 0; i < 20; ++i) n->add_data_nics(Padded(absl::StrCat("nic", i, "-"), 200, 'c'));
  for (int v = 1; v <= 64; ++v) {
    pb::VersionStatus* vs = st.add_versions();
    vs->set_model_id("a");
    vs->set_version(v);
    vs->set_state("committed");
    vs->set_error(std::string(40, 'e'));
  }
  const size_t full = st.ByteSizeLong();
  size_t versions_bytes = 0;
  for (const pb::VersionStatus& vs : st.versions()) versions_bytes += vs.ByteSizeLong() + 2;
  // Room for the versions but not for the NICs cut to kStatusListKeep (16 x 200 bytes).
  const size_t budget = versions_bytes + 400;
  ASSERT_LT(budget, full);

  pb::StatusResponse by_model = st;
  StatusTrim trim = FitStatusToBudget(&by_model, budget, StatusKeep::kVersions);
  EXPECT_TRUE(trim.fits) << trim.bytes_after;
  EXPECT_EQ(trim.versions_dropped, 0);
  EXPECT_EQ(trim.texts_cut, 0);
  EXPECT_EQ(by_model.versions_size(), 64) << "every record of the model is kept";
  ASSERT_EQ(by_model.nodes(0).data_nics_size(), 1) << "the node's list went altogether first";
  EXPECT_EQ(by_model.trimmed().data_nics_dropped(), 20u);
  // The default order drops the records before the list goes altogether.
  pb::StatusResponse unfiltered = st;
  trim = FitStatusToBudget(&unfiltered, budget);
  EXPECT_EQ(trim.versions_dropped, 63);

  // A node filter: the node's 20 NICs stay whole, the older records go.
  pb::StatusResponse by_node = st;
  const size_t nics_bytes = n->ByteSizeLong();
  trim = FitStatusToBudget(&by_node, nics_bytes + 400, StatusKeep::kNodeLists);
  EXPECT_TRUE(trim.fits) << trim.bytes_after;
  EXPECT_EQ(trim.lists_cut, 0);
  EXPECT_EQ(by_node.nodes(0).data_nics_size(), 20);
  EXPECT_EQ(trim.versions_dropped, 63);
  EXPECT_EQ(by_node.trimmed().versions_dropped_by_model().at("a"), 63u);
}

// A status that what is never dropped (node ids, addresses, workers) makes too big is sent as it
// is, marked over budget; nothing could be left out, so every count is 0.
TEST(StatusBudgetTest, AStatusTooBigByItselfIsMarkedOverBudget) {
  pb::StatusResponse st;
  for (int i = 0; i < 50; ++i) {
    pb::NodeStatus* n = st.add_nodes();
    n->set_node_id(Padded(absl::StrCat("n", i, "-"), 100, 'x'));
    pb::WorkerStatus* w = st.add_workers();
    w->set_worker_id(Padded(absl::StrCat("w", i, "-"), 100, 'y'));
  }
  const size_t full = st.ByteSizeLong();
  const StatusTrim trim = FitStatusToBudget(&st, full / 2);
  EXPECT_FALSE(trim.fits);
  EXPECT_EQ(st.nodes_size(), 50);
  EXPECT_EQ(st.workers_size(), 50);
  ASSERT_TRUE(st.has_trimmed());
  EXPECT_TRUE(st.trimmed().over_budget());
  EXPECT_EQ(st.trimmed().budget_bytes(), full / 2);
  EXPECT_EQ(st.trimmed().bytes_before(), full);
  EXPECT_EQ(st.trimmed().nodes_with_lists_cut() + st.trimmed().transports_dropped() + st.trimmed().data_nics_dropped() +
                st.trimmed().versions_dropped() + st.trimmed().texts_cut(),
            0u);
  EXPECT_EQ(trim.bytes_after, st.ByteSizeLong());
}

}  // namespace
}  // namespace wb::daemon

// StatusRequest's filter (docs/daemon.md "Status byte budget"): ClusterStatus and WatchStatus
// narrowed to one model (its status, version records and workers; every node still listed) or one
// node (that node and the workers on it), narrowed BEFORE the status byte budget, so that a model
// whose records the budget cut from the whole status is whole in a status of that model alone.
// Ids are checked as other requests check them; an unknown one is NOT_FOUND naming it.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/status_budget.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait in these tests

// A coordinator with fake nodes n0 and n1 (leases that outlast the test; nodes report a version
// done as soon as they are told to execute it). Model "a" has its trainer and rollout on n0, model
// "b" on n1; sync mode. Each node registers `nics` data NICs of 200 bytes.
class Cluster {
 public:
  explicit Cluster(int64_t max_status_bytes, int nics = 0) {
    CoordinatorOptions o;
    o.lease = absl::Hours(1000);
    o.max_status_bytes = max_status_bytes;
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        pb::ReportDoneResponse resp;
        return core->ReportDone(testing::DoneReport(node, req), &resp);
      };
      return fake;
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
    for (const char* node : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(node);
      req.set_address(absl::StrCat(node, ":1"));
      for (int i = 0; i < nics; ++i) {
        std::string nic = absl::StrCat(node, "-nic", i, "-");
        req.add_data_nics(nic + std::string(200 - nic.size(), 'c'));
      }
      pb::RegisterNodeResponse resp;
      EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
    }
    for (const auto& [model, node] : {std::pair{"a", "n0"}, std::pair{"b", "n1"}}) {
      for (auto [worker, role] : {std::pair{"t0", pb::ROLE_TRAINER}, std::pair{"r0", pb::ROLE_ROLLOUT}}) {
        pb::JoinWorkerRequest j;
        j.set_node_id(node);
        j.set_model_id(model);
        j.set_worker_id(absl::StrCat(model, "-", worker));
        j.set_role(role);
        *j.mutable_model() = testing::SmallModelSpec(model);
        pb::JoinWorkerResponse jr;
        absl::Status s = core->JoinWorker(j, &jr);
        EXPECT_TRUE(s.ok()) << s;
        pb::SubmitLayoutRequest l = testing::WholeTensorLayout(node, j.worker_id());
        l.set_model_id(model);
        pb::SubmitLayoutResponse lr;
        s = core->SubmitLayout(l, &lr);
        EXPECT_TRUE(s.ok()) << s;
      }
      EXPECT_TRUE(core->AwaitPlanInstalled(model, absl::Now() + kReal));
    }
  }
  ~Cluster() { core->Shutdown(); }

  // Sync: the rollout pauses for the version, the trainer's Publish returns once it is committed.
  void Commit(const std::string& model, uint64_t versions) {
    const std::string node = model == "a" ? "n0" : "n1";
    for (uint64_t v = 1; v <= versions; ++v) {
      pb::ReportReadyRequest ready;
      ready.set_node_id(node);
      ready.set_model_id(model);
      ready.set_worker_id(model + "-r0");
      pb::ReportReadyResponse ready_resp;
      ASSERT_TRUE(core->ReportReady(ready, &ready_resp).ok());
      pb::CoordPublishRequest p;
      p.set_model_id(model);
      p.set_worker_id(model + "-t0");
      p.set_node_id(node);
      p.set_version(v);
      p.set_timeout_ms(10000);
      pb::PublishResponse published;
      absl::Status s = core->Publish(p, &published);
      ASSERT_TRUE(s.ok()) << model << " v" << v << ": " << s;
    }
  }
  absl::StatusOr<pb::StatusResponse> Status(const std::string& model, const std::string& node = "") {
    pb::StatusRequest req;
    req.set_model_id(model);
    req.set_node_id(node);
    pb::StatusResponse st;
    absl::Status s = core->ClusterStatus(req, &st);
    if (!s.ok()) return s;
    return st;
  }
  // The first message of a WatchStatus stream with `filter`.
  absl::StatusOr<pb::StatusResponse> FirstWatched(const pb::StatusRequest& filter) {
    pb::WatchStatusRequest req;
    *req.mutable_request() = filter;
    req.set_timeout_ms(10000);
    pb::StatusResponse first;
    absl::Status ended = core->WatchStatus(
        req, [&](const pb::StatusResponse& s) { first = s; return false; }, [] { return false; });
    if (ended.code() != absl::StatusCode::kCancelled) return ended;  // write returned false: CANCELLED
    return first;
  }

  std::unique_ptr<CoordinatorCore> core;
};

std::set<std::string> ModelsOf(const pb::StatusResponse& st) {
  std::set<std::string> out;
  for (const pb::ModelStatus& m : st.models()) out.insert(m.model_id());
  return out;
}
std::set<std::string> NodesOf(const pb::StatusResponse& st) {
  std::set<std::string> out;
  for (const pb::NodeStatus& n : st.nodes()) out.insert(n.node_id());
  return out;
}
std::set<std::string> WorkersOf(const pb::StatusResponse& st) {
  std::set<std::string> out;
  for (const pb::WorkerStatus& w : st.workers()) out.insert(w.worker_id());
  return out;
}
// model -> versions listed (the budget's "trimmed" marker record counts as version 0).
std::map<std::string, std::set<uint64_t>> VersionsOf(const pb::StatusResponse& st) {
  std::map<std::string, std::set<uint64_t>> out;
  for (const pb::VersionStatus& v : st.versions()) out[v.model_id()].insert(v.version());
  return out;
}
std::set<uint64_t> OneTo(uint64_t n) {
  std::set<uint64_t> out;
  for (uint64_t v = 1; v <= n; ++v) out.insert(v);
  return out;
}

using Ids = std::set<std::string>;

TEST(StatusFilterTest, AModelFilterListsOnlyThatModelAndEveryNode) {
  Cluster c(/*max_status_bytes=*/0);
  c.Commit("a", 2);
  c.Commit("b", 3);
  absl::StatusOr<pb::StatusResponse> all = c.Status("");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(ModelsOf(*all), (Ids{"a", "b"}));
  EXPECT_EQ(WorkersOf(*all), (Ids{"a-t0", "a-r0", "b-t0", "b-r0"}));

  absl::StatusOr<pb::StatusResponse> a = c.Status("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->role(), "coordinator");
  EXPECT_EQ(ModelsOf(*a), (Ids{"a"}));
  EXPECT_EQ(WorkersOf(*a), (Ids{"a-t0", "a-r0"}));
  EXPECT_EQ(VersionsOf(*a), (std::map<std::string, std::set<uint64_t>>{{"a", OneTo(2)}}));
  EXPECT_EQ(NodesOf(*a), (Ids{"n0", "n1"})) << "every node is still listed";
  for (const pb::NodeStatus& n : a->nodes()) EXPECT_EQ(n.num_workers(), 2u) << n.node_id() << ": counts the workers of all models";
  EXPECT_FALSE(a->has_trimmed());

  // A node filter: that node and the workers on it; models and versions are not narrowed by it.
  absl::StatusOr<pb::StatusResponse> n1 = c.Status("", "n1");
  ASSERT_TRUE(n1.ok()) << n1.status();
  EXPECT_EQ(NodesOf(*n1), (Ids{"n1"}));
  EXPECT_EQ(WorkersOf(*n1), (Ids{"b-t0", "b-r0"}));
  EXPECT_EQ(ModelsOf(*n1), (Ids{"a", "b"}));
  EXPECT_EQ(VersionsOf(*n1), VersionsOf(*all));
  // Both: model a's workers on n1 (none), model a, node n1.
  absl::StatusOr<pb::StatusResponse> a_n1 = c.Status("a", "n1");
  ASSERT_TRUE(a_n1.ok()) << a_n1.status();
  EXPECT_EQ(NodesOf(*a_n1), (Ids{"n1"}));
  EXPECT_EQ(ModelsOf(*a_n1), (Ids{"a"}));
  EXPECT_TRUE(a_n1->workers().empty());

  // WatchStatus honours the same filter.
  pb::StatusRequest filter;
  filter.set_model_id("b");
  absl::StatusOr<pb::StatusResponse> watched = c.FirstWatched(filter);
  ASSERT_TRUE(watched.ok()) << watched.status();
  EXPECT_EQ(ModelsOf(*watched), (Ids{"b"}));
  EXPECT_EQ(WorkersOf(*watched), (Ids{"b-t0", "b-r0"}));
  EXPECT_EQ(VersionsOf(*watched), (std::map<std::string, std::set<uint64_t>>{{"b", OneTo(3)}}));
  EXPECT_EQ(NodesOf(*watched), (Ids{"n0", "n1"}));
}

// The filter is applied before the byte budget: with a budget between the size of model a's status
// and that of the whole one, the whole status drops a's older records (and b's), a status of model
// a alone lists every record of a and carries no trimmed note.
TEST(StatusFilterTest, AModelTrimmedFromTheWholeStatusIsWholeFiltered) {
  constexpr uint64_t kA = 8, kB = 40;
  size_t whole_bytes = 0, a_bytes = 0;
  {
    Cluster unbounded(0);
    unbounded.Commit("a", kA);
    unbounded.Commit("b", kB);
    absl::StatusOr<pb::StatusResponse> all = unbounded.Status("");
    absl::StatusOr<pb::StatusResponse> a = unbounded.Status("a");
    ASSERT_TRUE(all.ok() && a.ok());
    whole_bytes = all->ByteSizeLong();
    a_bytes = a->ByteSizeLong();
  }
  ASSERT_GT(whole_bytes, 2 * a_bytes) << "the case this test is about";
  const size_t budget = (whole_bytes + a_bytes) / 2;
  Cluster c(static_cast<int64_t>(budget));
  c.Commit("a", kA);
  c.Commit("b", kB);

  absl::StatusOr<pb::StatusResponse> all = c.Status("");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_TRUE(all->has_trimmed()) << all->ByteSizeLong() << " bytes, budget " << budget;
  EXPECT_EQ(all->trimmed().versions_dropped_by_model().at("a"), kA - 1) << "a's older records were cut from the whole status";
  EXPECT_LE(all->ByteSizeLong(), budget);

  absl::StatusOr<pb::StatusResponse> a = c.Status("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->has_trimmed()) << a->trimmed().ShortDebugString();
  EXPECT_EQ(VersionsOf(*a), (std::map<std::string, std::set<uint64_t>>{{"a", OneTo(kA)}}));
  for (const pb::VersionStatus& v : a->versions()) EXPECT_EQ(v.state(), "committed") << v.version();

  // WatchStatus with the filter: the same whole status.
  pb::StatusRequest filter;
  filter.set_model_id("a");
  absl::StatusOr<pb::StatusResponse> watched = c.FirstWatched(filter);
  ASSERT_TRUE(watched.ok()) << watched.status();
  EXPECT_FALSE(watched->has_trimmed());
  EXPECT_EQ(VersionsOf(*watched), (std::map<std::string, std::set<uint64_t>>{{"a", OneTo(kA)}}));
}

// A status of one model keeps that model's records longest: the nodes' NIC lists go altogether
// (they are still listed, each with its marker entry) before any record of the model does.
TEST(StatusFilterTest, AModelFilterCutsNodeListsBeforeTheModelsRecords) {
  constexpr uint64_t kA = 8;
  constexpr int kNics = 20;
  size_t a_bytes = 0, lists_bytes = 0;
  {
    Cluster unbounded(0, kNics);
    unbounded.Commit("a", kA);
    absl::StatusOr<pb::StatusResponse> a = unbounded.Status("a");
    ASSERT_TRUE(a.ok()) << a.status();
    a_bytes = a->ByteSizeLong();
    for (const pb::NodeStatus& n : a->nodes()) {
      for (const std::string& nic : n.data_nics()) lists_bytes += nic.size() + 2;
    }
  }
  // Room for model a with its records but not for the NICs, not even cut to kStatusListKeep.
  const size_t budget = a_bytes - lists_bytes + 400;
  Cluster c(static_cast<int64_t>(budget), kNics);
  c.Commit("a", kA);
  absl::StatusOr<pb::StatusResponse> a = c.Status("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_LE(a->ByteSizeLong(), budget);
  EXPECT_EQ(VersionsOf(*a), (std::map<std::string, std::set<uint64_t>>{{"a", OneTo(kA)}})) << "the model's records are whole";
  ASSERT_TRUE(a->has_trimmed());
  EXPECT_EQ(a->trimmed().versions_dropped(), 0u);
  EXPECT_EQ(a->trimmed().data_nics_dropped(), 2u * kNics);
  EXPECT_EQ(NodesOf(*a), (Ids{"n0", "n1"}));
  for (const pb::NodeStatus& n : a->nodes()) EXPECT_EQ(n.data_nics_size(), 1) << n.node_id() << ": only the marker entry";
}

TEST(StatusFilterTest, UnknownOrMalformedIdsAreRefused) {
  Cluster c(0);
  absl::StatusOr<pb::StatusResponse> st = c.Status("nope");
  EXPECT_EQ(st.status().code(), absl::StatusCode::kNotFound) << st.status();
  EXPECT_NE(st.status().message().find("unknown model 'nope'"), std::string::npos) << st.status();
  st = c.Status("", "n9");
  EXPECT_EQ(st.status().code(), absl::StatusCode::kNotFound) << st.status();
  EXPECT_NE(st.status().message().find("unknown node 'n9'"), std::string::npos) << st.status();
  // As other requests: at most max_name_bytes (1024), no control characters; echoed cut and escaped.
  st = c.Status(std::string(1025, 'm'));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
  EXPECT_NE(st.status().message().find("StatusRequest.model_id is 1025 bytes"), std::string::npos) << st.status();
  EXPECT_LT(st.status().message().size(), 300u);
  st = c.Status("", "n0\r\nx");
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
  EXPECT_NE(st.status().message().find("StatusRequest.node_id contains a control character"), std::string::npos) << st.status();

  // WatchStatus refuses at once, before taking a watcher slot.
  pb::StatusRequest filter;
  filter.set_model_id("nope");
  absl::StatusOr<pb::StatusResponse> watched = c.FirstWatched(filter);
  EXPECT_EQ(watched.status().code(), absl::StatusCode::kNotFound) << watched.status();
  EXPECT_NE(watched.status().message().find("unknown model 'nope'"), std::string::npos) << watched.status();
  EXPECT_TRUE(c.core->AwaitStatusWatchersAtMost(0, absl::Now() + kReal));
}

}  // namespace
}  // namespace wb::daemon

// Model and worker rules (issue 16.5) against real daemons, standalone and coordinator + node: a
// worker joining an existing model with a different spec is refused naming the worker, the model
// and every differing field (before: the first spec won silently); layout errors name worker and
// model.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr char kTinyQwen2[] = R"({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,
  "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
  "vocab_size":256,"tie_word_embeddings":false})";

class ModelRulesTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      // One standalone daemon: coordinator and node in one process.
      ServerOptions o;
      o.role = DaemonRole::kStandalone;
      o.node_id = "n0";
      o.worker_socket = absl::StrCat("/tmp/wbmr-", ::getpid(), ".sock");
      o.heartbeat = absl::Milliseconds(100);
      o.make_transports = HostTransports;
      auto s = Server::Start(o);
      ASSERT_TRUE(s.ok()) << s.status();
      c_.nodes_.push_back(std::move(*s));
    } else {
      c_.StartCoordinator();
      c_.StartNode(0);
    }
  }
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

TEST_P(ModelRulesTest, WorkerWithADifferentSpecIsRefusedNamingTheFields) {
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  const planner::WorkerLayout whole = LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  ASSERT_TRUE(c_.Register(t0, spec).ok());

  TestWorker& r3 = c_.AddWorker("rollout/3", pb::ROLE_ROLLOUT, 0, &inv_, whole);
  pb::ModelSpec other = spec;
  other.set_mode(pb::MODE_ONE_STEP_OFF);
  other.set_num_rollout_workers(8);
  other.set_strategy(pb::STRATEGY_P2P_NO_DEDUP);
  grpc::Status s = c_.Register(r3, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (const char* want : {"model 'm'", "worker 'rollout/3' (rollout)", "mode MODE_ONE_STEP_OFF, the model has MODE_SYNC",
                           "num_rollout_workers 8, the model has 2", "strategy STRATEGY_P2P_NO_DEDUP, the model has STRATEGY_WEIGHTBRIDGE"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  EXPECT_EQ(s.error_message().find("num_trainer_workers"), std::string::npos) << "only differing fields: " << s.error_message();

  // Other tensors, dtype, counts, staleness: each named.
  other = spec;
  other.mutable_explicit_tensors()->mutable_tensors(1)->set_shape(0, 5);
  other.set_dtype(pb::DTYPE_F32);
  other.set_num_trainer_workers(1);
  other.set_max_staleness(3);
  s = c_.Register(r3, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (const char* want : {"explicit_tensors (2 tensors) that differ from the model's (2 tensors) at tensor 1 'b'", "dtype DTYPE_F32, the model has DTYPE_BF16",
                           "num_trainer_workers 1, the model has 2", "max_staleness 3, the model has 0"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  // A config instead of tensors.
  other = spec;
  other.set_hf_config_json(kTinyQwen2);
  s = c_.Register(r3, other);
  EXPECT_NE(s.error_message().find("inventory hf_config_json, the model has explicit_tensors"), std::string::npos) << s.error_message();

  // The model's own spec (unset enums are their defaults) is accepted, and the model still works.
  other = spec;
  other.set_mode(pb::MODE_UNSPECIFIED);
  other.set_strategy(pb::STRATEGY_UNSPECIFIED);
  other.set_dtype(pb::DTYPE_UNSPECIFIED);
  s = c_.Register(r3, other);
  EXPECT_TRUE(s.ok()) << s.error_message();
  pb::StatusResponse st = c_.Status(t0);
  ASSERT_EQ(st.models_size(), 1);
  EXPECT_EQ(st.models(0).mode(), pb::MODE_SYNC) << "the first spec stays";
}

// Worker t0 of a second model on the same node, from the same process: accepted (worker ids are
// scoped per model), and the first model's versions still reach its rollout byte for byte (before:
// the second registration replaced the first on the node and broke the first model's publish).
TEST_P(ModelRulesTest, SameWorkerIdOfAnotherModelDoesNotBreakTheFirst) {
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  const planner::WorkerLayout whole = LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, whole);
  for (TestWorker* w : {&t0, &r0}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;
  pb::ModelSpec second = spec;
  second.set_model_id("m2");
  TestWorker& other = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  grpc::Status s = c_.Register(other, second);
  EXPECT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  for (auto& p : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0}, {&r0})) ASSERT_TRUE(p.ok()) << p.error_message();
  ASSERT_TRUE(c_.Apply(r0, "m", 1, &resp).ok());
  EXPECT_EQ(CountBad(r0, 1), 0);
  // Errors about a worker name its model too.
  grpc::Status a = c_.Apply(t0, "m", 1, &resp);
  EXPECT_NE(a.error_message().find("worker t0 of model m is not a rollout worker on node n0"), std::string::npos) << a.error_message();
  grpc::ClientContext ctx;
  pb::PublishRequest pr;
  pr.set_model_id("m");
  pr.set_worker_id("r0");
  pr.set_version(2);
  pr.set_timeout_ms(5000);
  pb::PublishResponse presp;
  grpc::Status p = r0.stub->Publish(&ctx, pr, &presp);
  EXPECT_NE(p.error_message().find("worker r0 of model m is not a trainer"), std::string::npos) << p.error_message();
}

// A preset layout whose buffer is too small: the error names worker and model.
TEST_P(ModelRulesTest, PresetBufferTooSmallNamesWorkerAndModel) {
  pb::ModelSpec spec;
  spec.set_model_id("qwen");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  planner::WorkerLayout tiny;
  tiny.buffers.push_back({256});
  TestWorker& r9 = c_.AddWorker("r9", pb::ROLE_ROLLOUT, 0, &inv_, tiny);
  pb::ParallelConfig pc;
  pc.set_preset("vllm");
  pc.set_replicas(1);
  pc.set_rank(0);
  grpc::Status s = c_.Register(r9, spec, &pc);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  for (const char* want : {"r9", "qwen", "needs"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
}

// ---------------------------------------------------------------- worker ids scoped per model
// Issue 16.5: two models may each have a trainer/0 and a rollout/0 on one node, registered from
// one process or from two, and each model's versions reach its own rollout byte for byte. The
// rollouts' layouts differ (m row-major, m2 transposed), so bytes landing in the other model's
// worker, or one model's registration replacing the other's, show as bad elements.

// One model's cast: trainer/0 and rollout/0, 1 + 1 workers, one-step-off.
struct Cast {
  pb::ModelSpec spec;
  TestWorker* t = nullptr;
  TestWorker* r = nullptr;
};

pb::ModelSpec OneAndOne(const std::string& model) {
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_model_id(model);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  return spec;
}

Cast AddCast(Cluster& c, const planner::Inventory& inv, const std::string& model, int tnode, int rnode, bool transposed) {
  Cast k;
  k.spec = OneAndOne(model);
  k.t = &c.AddWorker("trainer/0", pb::ROLE_TRAINER, tnode, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  k.r = &c.AddWorker("rollout/0", pb::ROLE_ROLLOUT, rnode, &inv,
                     LayoutOf(inv, {{0, {0, 0}, {8, 16}, transposed}, {1, {0, 0}, {4, 6}, transposed}}));
  return k;
}

// Publishes version v of k's model and applies it: "" when its rollout then holds v byte for byte.
std::string Step(Cluster& c, Cast& k, uint64_t v) {
  for (grpc::Status& p : c.Publish(k.spec.model_id(), pb::MODE_ONE_STEP_OFF, v, {k.t}, {k.r})) {
    if (!p.ok()) return absl::StrCat("publish ", k.spec.model_id(), " v", v, ": ", p.error_message());
  }
  pb::ApplyResponse resp;
  grpc::Status a = c.Apply(*k.r, k.spec.model_id(), v, &resp);
  if (!a.ok()) return absl::StrCat("apply ", k.spec.model_id(), " v", v, ": ", a.error_message());
  if (resp.applied_version() != v) return absl::StrCat("apply ", k.spec.model_id(), " v", v, ": applied ", resp.applied_version());
  const int64_t bad = CountBad(*k.r, v);
  return bad == 0 ? "" : absl::StrCat(k.spec.model_id(), " v", v, ": ", bad, " bad elements");
}

TEST_P(ModelRulesTest, TwoModelsEachWithTrainer0AndRollout0FromOneProcess) {
  Cast m = AddCast(c_, inv_, "m", 0, 0, false);
  Cast m2 = AddCast(c_, inv_, "m2", 0, 0, true);
  // Interleaved: m's trainer/0, m2's trainer/0, m's rollout/0, m2's rollout/0.
  for (auto [w, spec] : {std::pair{m.t, &m.spec}, {m2.t, &m2.spec}, {m.r, &m.spec}, {m2.r, &m2.spec}}) {
    grpc::Status s = c_.Register(*w, *spec);
    ASSERT_TRUE(s.ok()) << w->id << " of " << spec->model_id() << ": " << s.error_message();
  }
  EXPECT_EQ(Step(c_, m, 1), "");
  EXPECT_EQ(Step(c_, m2, 1), "");
  EXPECT_EQ(Step(c_, m2, 2), "");
  EXPECT_EQ(CountBad(*m.r, 1), 0) << "m's rollout/0 must still hold m's version 1";
  EXPECT_EQ(Step(c_, m, 3), "");
  EXPECT_EQ(CountBad(*m2.r, 2), 0) << "m2's rollout/0 must still hold m2's version 2";
  // Status names each worker with its model; each is whole.
  pb::StatusResponse st = c_.Status(*m.t);
  int seen = 0;
  for (const pb::WorkerStatus& ws : st.workers()) {
    if (ws.worker_id() != "rollout/0") continue;
    ++seen;
    EXPECT_EQ(ws.applied_version(), ws.model_id() == "m" ? 3u : 2u) << ws.model_id();
    EXPECT_EQ(ws.live_state(), "whole") << ws.model_id();
  }
  EXPECT_EQ(seen, 2);
  // One model's worker leaving leaves the other's alone.
  grpc::ClientContext ctx;
  pb::DeregisterRequest dr;
  dr.set_model_id("m2");
  dr.set_worker_id("rollout/0");
  pb::DeregisterResponse dresp;
  ASSERT_TRUE(m2.r->stub->Deregister(&ctx, dr, &dresp).ok());
  EXPECT_EQ(Step(c_, m, 4), "");
}

// ---- a second process: the test binary run again as a worker of one model (ModelRulesChild).
// Commands on fd WB_MR_IN, one per line ("step <v>"); answers on fd WB_MR_OUT ("" = ok, else
// the error), one per line. Registers trainer/0 and rollout/0 (transposed) of WB_MR_MODEL on
// WB_MR_SOCKET first and answers that; exits at EOF.
class ChildWorkers {
 public:
  ~ChildWorkers() { Stop(); }
  absl::Status Start(const std::string& socket, const std::string& model) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
    char exe[4096];
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return absl::InternalError("readlink /proc/self/exe");
    exe[n] = '\0';
    // The child's ends survive exec; ours do not (EOF reaches it when we close ours).
    ::fcntl(in[0], F_SETFD, 0);
    ::fcntl(out[1], F_SETFD, 0);
    std::vector<std::string> env_s = {absl::StrCat("WB_MR_SOCKET=", socket), absl::StrCat("WB_MR_MODEL=", model),
                                      absl::StrCat("WB_MR_IN=", in[0]), absl::StrCat("WB_MR_OUT=", out[1])};
    for (char** e = environ; *e != nullptr; ++e) env_s.push_back(*e);
    std::vector<char*> envp;
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=ModelRulesChild.Serve";
    char* argv[] = {exe, filter.data(), nullptr};
    const int rc = ::posix_spawn(&pid_, exe, nullptr, nullptr, argv, envp.data());
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn: ", rc));
    return Expect("registered");
  }
  // Sends `cmd`, returns its answer ("" = ok).
  std::string Do(const std::string& cmd) {
    const std::string line = cmd + "\n";
    if (::write(to_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return "write to child failed";
    absl::StatusOr<std::string> a = ReadLine(absl::Now() + absl::Seconds(40));
    return a.ok() ? *a : std::string(a.status().message());
  }
  pid_t pid() const { return pid_; }
  void Stop() {
    if (to_ >= 0) ::close(to_);
    to_ = -1;
    if (pid_ > 0) {
      // It exits at EOF; waited for on its pidfd, bounded: killed if it has not after 10 s.
      const int pfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
      pollfd p{pfd, POLLIN, 0};
      if (pfd < 0 || ::poll(&p, 1, 10000) != 1) ::kill(pid_, SIGKILL);
      if (pfd >= 0) ::close(pfd);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    if (from_ >= 0) ::close(from_);
    from_ = -1;
  }

 private:
  absl::Status Expect(const std::string& want) {
    absl::StatusOr<std::string> a = ReadLine(absl::Now() + absl::Seconds(40));
    if (!a.ok()) return a.status();
    return *a == want ? absl::OkStatus() : absl::InternalError(absl::StrCat("child: ", *a));
  }
  absl::StatusOr<std::string> ReadLine(absl::Time deadline) {
    std::string line;
    while (true) {
      pollfd p{from_, POLLIN, 0};
      const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
      if (::poll(&p, 1, ms) <= 0) return absl::DeadlineExceededError("no answer from the child worker process");
      char ch;
      if (::read(from_, &ch, 1) != 1) return absl::UnavailableError("the child worker process exited");
      if (ch == '\n') return line;
      line.push_back(ch);
    }
  }
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

TEST(ModelRulesChild, Serve) {
  const char* socket = std::getenv("WB_MR_SOCKET");
  if (socket == nullptr) GTEST_SKIP() << "only as the second process of the per-model worker id tests";
  const int in = std::atoi(std::getenv("WB_MR_IN")), out = std::atoi(std::getenv("WB_MR_OUT"));
  auto say = [&](const std::string& s) {
    std::string line = s;
    for (char& ch : line) ch = ch == '\n' ? ' ' : ch;
    line.push_back('\n');
    (void)!::write(out, line.data(), line.size());
  };
  Cluster c;
  c.external_sockets_[0] = socket;
  const planner::Inventory inv = SmallInventory();
  Cast k = AddCast(c, inv, std::getenv("WB_MR_MODEL"), 0, 0, true);
  std::string registered = "registered";
  for (TestWorker* w : {k.t, k.r}) {
    grpc::Status s = c.Register(*w, k.spec);
    if (!s.ok()) registered = absl::StrCat(w->id, ": ", s.error_message());
  }
  say(registered);
  std::string line;
  char ch;
  while (::read(in, &ch, 1) == 1) {  // EOF: the parent is done (or gone)
    if (ch != '\n') {
      line.push_back(ch);
      continue;
    }
    uint64_t v = 0;
    absl::string_view cmd = line;
    if (absl::ConsumePrefix(&cmd, "step ") && absl::SimpleAtoi(cmd, &v)) {
      say(Step(c, k, v));
    } else {
      say(absl::StrCat("unknown command: ", line));
    }
    line.clear();
  }
  c.Stop();
}

std::string SocketOf(Cluster& c) { return c.nodes_[0]->worker_socket(); }

TEST_P(ModelRulesTest, TwoModelsEachWithTrainer0AndRollout0FromTwoProcesses) {
  ChildWorkers child;
  // The child registers m2's trainer/0 and rollout/0 first, then this process m's.
  absl::Status started = child.Start(SocketOf(c_), "m2");
  ASSERT_TRUE(started.ok()) << started;
  Cast m = AddCast(c_, inv_, "m", 0, 0, false);
  for (TestWorker* w : {m.t, m.r}) {
    grpc::Status s = c_.Register(*w, m.spec);
    ASSERT_TRUE(s.ok()) << w->id << " of m (m2's is held by process " << child.pid() << "): " << s.error_message();
  }
  EXPECT_EQ(Step(c_, m, 1), "");
  EXPECT_EQ(child.Do("step 1"), "");
  EXPECT_EQ(child.Do("step 2"), "");
  EXPECT_EQ(CountBad(*m.r, 1), 0) << "m's rollout/0 must still hold m's version 1";
  EXPECT_EQ(Step(c_, m, 3), "");
  EXPECT_EQ(child.Do("step 3"), "");
  EXPECT_EQ(CountBad(*m.r, 3), 0);
}

// The same (model, worker) held by another live process is still refused, naming both.
TEST_P(ModelRulesTest, SameModelAndWorkerOfAnotherLiveProcessIsRefused) {
  ChildWorkers child;
  absl::Status started = child.Start(SocketOf(c_), "m");
  ASSERT_TRUE(started.ok()) << started;
  TestWorker& t = c_.AddWorker("trainer/0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  grpc::Status s = c_.Register(t, OneAndOne("m"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  for (const std::string& want : {std::string("worker trainer/0 of model 'm'"), absl::StrCat("held by live process ", child.pid())}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  // The child's m keeps working; the same id of another model is this process's to take.
  EXPECT_EQ(child.Do("step 1"), "");
  ASSERT_TRUE(c_.Register(t, OneAndOne("m3")).ok());
  EXPECT_EQ(child.Do("step 2"), "");
}

// Through a coordinator with two nodes: each model's trainer/0 on n0 sends to its rollout/0 on
// n1 (cross-node), both models from one process.
TEST(ModelRulesClusterTest, TwoModelsSameWorkerIdsAcrossTwoNodes) {
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  const planner::Inventory inv = SmallInventory();
  Cast m = AddCast(c, inv, "m", 0, 1, false);
  Cast m2 = AddCast(c, inv, "m2", 0, 1, true);
  for (auto [w, spec] : {std::pair{m.t, &m.spec}, {m2.t, &m2.spec}, {m.r, &m.spec}, {m2.r, &m2.spec}}) {
    grpc::Status s = c.Register(*w, *spec);
    ASSERT_TRUE(s.ok()) << w->id << " of " << spec->model_id() << ": " << s.error_message();
  }
  EXPECT_EQ(Step(c, m, 1), "");
  EXPECT_EQ(Step(c, m2, 1), "");
  EXPECT_EQ(Step(c, m2, 2), "");
  EXPECT_EQ(CountBad(*m.r, 1), 0);
  EXPECT_EQ(Step(c, m, 3), "");
  EXPECT_EQ(CountBad(*m2.r, 2), 0);
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(StandaloneAndCluster, ModelRulesTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Standalone" : "CoordinatorAndNode"; });

}  // namespace
}  // namespace wb::daemon

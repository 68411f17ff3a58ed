// Coordinator + two node daemons as objects in one process on 127.0.0.1:0, workers as gRPC clients
// on the nodes' Unix sockets with shared-memory weights, bytes moved by the real transports
// (host_shm same-node, host_tcp cross-node) on plans from planner::MakePlan: every rollout byte
// must equal the canonical weights of the applied version, in every mode and strategy.
#include <chrono>
#include <grpcpp/grpcpp.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <fstream>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/ctl_client.h"
#include "daemon/convert.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/server.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tools/cc/weight_gen.h"
#include "transport/factory.h"
#include "transport/shm_segment.h"

namespace wb::daemon {
namespace {

struct TestWorker {
  std::string id;
  pb::Role role;
  int node = 0;
  const planner::Inventory* inventory = nullptr;
  planner::WorkerLayout layout;  // buffer 0 = seg
  transport::ShmSegment seg;
  std::unique_ptr<pb::WorkerService::Stub> stub;
};

// Calls fn(flat canonical index, byte address) for every element of every piece of `w`.
template <typename Fn>
void ForEachElement(const TestWorker& w, Fn fn) {
  for (const planner::Piece& p : w.layout.pieces) {
    const planner::TensorSpec& t = w.inventory->tensors[p.tensor];
    const int elem = planner::DTypeSize(t.dtype);
    std::vector<int64_t> c = p.box.begin;
    const size_t rank = c.size();
    if (planner::BoxEmpty(p.box)) continue;
    // Odometer over the box; `more` turns false after its last element (then the next piece:
    // returning here instead once checked the first piece of every worker only).
    for (bool more = true; more;) {
      int64_t flat = 0, local = 0;
      for (size_t d = 0; d < rank; ++d) {
        flat = flat * t.shape[d] + c[d];
        local += (c[d] - p.box.begin[d]) * p.strides[d];
      }
      fn(p.tensor, elem, flat, static_cast<uint8_t*>(w.seg.data()) + p.offset_bytes + local * elem);
      more = false;
      for (size_t d = rank; d > 0; --d) {
        if (++c[d - 1] < p.box.end[d - 1]) {
          more = true;
          break;
        }
        c[d - 1] = p.box.begin[d - 1];
      }
    }
  }
}

void Fill(TestWorker& w, uint64_t version) {
  ForEachElement(w, [&](int32_t t, int elem, int64_t flat, uint8_t* at) { WriteWeight(t, version, flat, elem, at); });
}

int64_t CountBad(const TestWorker& w, uint64_t version) {
  int64_t bad = 0;
  ForEachElement(w, [&](int32_t t, int elem, int64_t flat, uint8_t* at) { bad += !CheckWeight(t, version, flat, elem, at); });
  return bad;
}

absl::StatusOr<transport::TransportSet> HostTransports() {
  transport::TransportConfig tc;
  tc.kinds = {"host_shm", "host_tcp"};
  return transport::CreateTransports(tc);
}

class Cluster {
 public:
  void StartCoordinator(absl::Duration lease = absl::Seconds(3), const std::string& listen = "127.0.0.1:0",
                        const std::function<void(ServerOptions&)>& configure = nullptr) {
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.listen = listen;
    co.transfer_timeout = absl::Seconds(20);
    co.lease = lease;
    co.bucket_bytes = 4096;  // several buckets, so relays and staged reads cross bucket boundaries
    if (configure) configure(co);
    auto c = Server::Start(co);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
  }
  void StartNode(int n, std::function<void(const std::string&, uint64_t, uint32_t)> hook = nullptr,
                 std::function<bool()> skip_heartbeat = nullptr, std::function<void(ServerOptions&)> configure = nullptr) {
    ServerOptions no;
    no.role = DaemonRole::kNode;
    no.node_id = absl::StrCat("n", n);
    no.coordinator = coord_->address();
    no.worker_socket = absl::StrCat("/tmp/wbmn-", ::getpid(), "-", n, ".sock");  // unix paths max 107 chars
    no.heartbeat = absl::Milliseconds(100);
    no.make_transports = HostTransports;
    no.test_before_bucket = std::move(hook);
    no.test_skip_heartbeat = std::move(skip_heartbeat);
    if (configure) configure(no);
    auto s = Server::Start(no);
    ASSERT_TRUE(s.ok()) << s.status();
    if (nodes_.size() <= static_cast<size_t>(n)) nodes_.resize(n + 1);
    nodes_[n] = std::move(*s);
  }
  void Stop() {
    workers_.clear();
    for (auto& n : nodes_) if (n) n->Shutdown();
    if (coord_) coord_->Shutdown();
  }

  TestWorker& AddWorker(const std::string& id, pb::Role role, int node, const planner::Inventory* inv, planner::WorkerLayout layout) {
    auto w = std::make_unique<TestWorker>();
    w->id = id;
    w->role = role;
    w->node = node;
    w->inventory = inv;
    w->layout = std::move(layout);
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("mn"), w->layout.buffers[0].size_bytes + 64);
    EXPECT_TRUE(seg.ok()) << seg.status();
    w->seg = std::move(*seg);
    Connect(*w);
    workers_.push_back(std::move(w));
    return *workers_.back();
  }
  void Connect(TestWorker& w) {
    w.stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", nodes_[w.node]->worker_socket()),
                                                            grpc::InsecureChannelCredentials()));
  }

  // Registers the worker and its layout: explicit pieces, or `preset` when given.
  grpc::Status Register(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset = nullptr, int pid = ::getpid()) {
    grpc::ClientContext c1;
    pb::RegisterWorkerRequest rw;
    rw.set_model_id(spec.model_id());
    rw.set_worker_id(w.id);
    rw.set_role(w.role);
    rw.set_gpu(-1);
    rw.set_pid(pid);
    *rw.mutable_model() = spec;
    pb::RegisterWorkerResponse rwr;
    grpc::Status s = w.stub->RegisterWorker(&c1, rw, &rwr);
    if (!s.ok()) return s;
    return RegisterLayout(w, spec, preset);
  }

  // RegisterLayout alone: explicit pieces of w.layout, or `preset` when given.
  grpc::Status RegisterLayout(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset = nullptr) {
    pb::RegisterLayoutRequest rl;
    rl.set_model_id(spec.model_id());
    rl.set_worker_id(w.id);
    pb::BufferSpec* b = rl.add_buffers();
    b->set_buffer_id(7);
    b->set_size_bytes(static_cast<uint64_t>(w.seg.size()));
    b->set_shm_name(w.seg.name());
    b->set_gpu(-1);
    if (preset != nullptr) {
      *rl.mutable_layout()->mutable_preset() = *preset;
    } else {
      for (const planner::Piece& p : w.layout.pieces) {
        pb::Piece* pp = rl.mutable_layout()->mutable_pieces()->add_pieces();
        pp->set_tensor(w.inventory->tensors[p.tensor].name);
        ToProto(p.box, pp->mutable_box());
        pp->set_buffer_id(7);
        pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
        for (int64_t st : p.strides) pp->add_strides(st);
      }
    }
    grpc::ClientContext c2;
    pb::RegisterLayoutResponse rlr;
    return w.stub->RegisterLayout(&c2, rl, &rlr);
  }

  // One version: (sync) pause rollouts, every trainer publishes, (non-sync) trainers scribble,
  // returns the trainers' publish statuses.
  std::vector<grpc::Status> Publish(const std::string& model, pb::Mode mode, uint64_t v, const std::vector<TestWorker*>& trainers,
                                    const std::vector<TestWorker*>& rollouts) {
    for (TestWorker* t : trainers) Fill(*t, v);
    if (mode == pb::MODE_SYNC) {
      for (TestWorker* r : rollouts) {
        grpc::ClientContext ctx;
        pb::BeginUpdateRequest req;
        req.set_model_id(model);
        req.set_worker_id(r->id);
        pb::BeginUpdateResponse resp;
        EXPECT_TRUE(r->stub->BeginUpdate(&ctx, req, &resp).ok());
      }
    }
    std::vector<std::thread> threads;
    std::vector<grpc::Status> st(trainers.size());
    for (size_t i = 0; i < trainers.size(); ++i) {
      threads.emplace_back([&, i] {
        grpc::ClientContext ctx;
        pb::PublishRequest req;
        req.set_model_id(model);
        req.set_worker_id(trainers[i]->id);
        req.set_version(v);
        req.set_timeout_ms(20000);
        pb::PublishResponse resp;
        st[i] = trainers[i]->stub->Publish(&ctx, req, &resp);
      });
    }
    for (auto& th : threads) th.join();
    // Trainers move on (their weights change) - staging must not care.
    if (mode != pb::MODE_SYNC) {
      for (TestWorker* t : trainers) Fill(*t, 99);
    }
    return st;
  }

  grpc::Status Apply(TestWorker& r, const std::string& model, uint64_t v, pb::ApplyResponse* resp) {
    grpc::ClientContext ctx;
    pb::ApplyRequest req;
    req.set_model_id(model);
    req.set_worker_id(r.id);
    req.set_version(v);
    req.set_timeout_ms(20000);
    return r.stub->Apply(&ctx, req, resp);
  }

  // Waits (bounded) on the coordinator's status push until `pred` holds.
  absl::StatusOr<pb::StatusResponse> WaitForCoordinator(const std::function<bool(const pb::StatusResponse&)>& pred,
                                                        absl::Duration timeout) {
    auto client = client::CtlClient::Connect(coord_->address(), timeout);
    if (!client.ok()) return client.status();
    return (*client)->WaitForStatus(pred, absl::Now() + timeout);
  }

  pb::StatusResponse Status(TestWorker& w) {
    grpc::ClientContext ctx;
    pb::StatusResponse status;
    EXPECT_TRUE(w.stub->Status(&ctx, pb::StatusRequest(), &status).ok());
    return status;
  }

  std::unique_ptr<Server> coord_;
  std::vector<std::unique_ptr<Server>> nodes_;
  std::vector<std::unique_ptr<TestWorker>> workers_;
};

// ------------------------------------------------------------------ explicit pieces, 2 tensors
struct PieceDef { int tensor; std::vector<int64_t> begin, end; bool transposed; };

planner::Inventory SmallInventory() {
  planner::Inventory inv;
  inv.tensors = {{"a", {8, 16}, planner::DType::kF32}, {"b", {4, 6}, planner::DType::kBF16}};
  return inv;
}

planner::WorkerLayout LayoutOf(const planner::Inventory& inv, const std::vector<PieceDef>& defs) {
  planner::WorkerLayout l;
  int64_t off = 0;
  for (const PieceDef& d : defs) {
    planner::Piece p;
    p.tensor = d.tensor;
    p.box = {d.begin, d.end};
    p.offset_bytes = off;
    int64_t rows = d.end[0] - d.begin[0], cols = d.end[1] - d.begin[1];
    p.strides = d.transposed ? std::vector<int64_t>{1, rows} : std::vector<int64_t>{cols, 1};
    off += rows * cols * planner::DTypeSize(inv.tensors[d.tensor].dtype);
    l.pieces.push_back(p);
  }
  l.buffers.push_back({off});
  return l;
}

pb::ModelSpec SmallSpec(pb::Mode mode, pb::Strategy strategy) {
  pb::ModelSpec spec;
  spec.set_model_id("m");
  for (const planner::TensorSpec& t : SmallInventory().tensors) {
    pb::TensorSpec* ts = spec.mutable_explicit_tensors()->add_tensors();
    ts->set_name(t.name);
    ts->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    ts->set_dtype(ToProto(t.dtype));
  }
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(2);
  spec.set_mode(mode);
  spec.set_strategy(strategy);
  return spec;
}

// The two-node cast most fault tests use: trainers t0 (n0, rows 0-3 of `a` and all of `b`) and t1
// (n1, rows 4-7), so every version has cross-node ops; rollouts r0 (n0) and r1 (n1, transposed)
// each hold the whole model.
struct TwoNodeWorkers {
  TestWorker &t0, &t1, &r0, &r1;
};
TwoNodeWorkers AddTwoNodeWorkers(Cluster& c, const planner::Inventory& inv) {
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv, LayoutOf(inv, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  return {t0, t1, r0, r1};
}

class MultiNodeTest : public ::testing::TestWithParam<std::tuple<pb::Mode, pb::Strategy>> {
 protected:
  void SetUp() override {
    c_.StartCoordinator();
    c_.StartNode(0);
    c_.StartNode(1);
  }
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

// Waits (bounded) until the coordinator recorded version v of `model` as committed: a rollout's
// Apply returns once its node committed, the coordinator records the commit after every node
// acknowledged it.
grpc::Status WaitCommitted(TestWorker& w, const std::string& model, uint64_t v) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  pb::WaitVersionRequest req;
  req.set_model_id(model);
  req.set_version(v);
  req.set_timeout_ms(20000);
  pb::WaitVersionResponse r;
  return w.stub->WaitVersion(&ctx, req, &r);
}

TEST_P(MultiNodeTest, BytesArriveByteExact) {
  const auto [mode, strategy] = GetParam();
  pb::ModelSpec spec = SmallSpec(mode, strategy);
  // Trainers split `a` by rows across nodes; rollouts split it by columns (one transposed).
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c_.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv_, LayoutOf(inv_, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 8}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, {{0, {0, 8}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;

  // A malformed layout is rejected naming tensor and box, and changes nothing.
  {
    TestWorker& bad = c_.AddWorker("bad", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {9, 16}, false}}));
    grpc::Status s = c_.Register(bad, spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("[0:9, 0:16]"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("a"), std::string::npos) << s.error_message();
  }

  for (uint64_t v : {1u, 2u}) {
    for (auto& s : c_.Publish("m", mode, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c_.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 2).ok());
  pb::StatusResponse status = c_.Status(r0);
  ASSERT_EQ(status.models_size(), 1);
  EXPECT_EQ(status.models(0).committed_version(), 2u);
  EXPECT_EQ(status.models(0).strategy(), strategy);
  EXPECT_GT(status.models(0).last_transfer_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(ModesAndStrategies, MultiNodeTest,
                         ::testing::Combine(::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                                            ::testing::Values(pb::STRATEGY_WEIGHTBRIDGE, pb::STRATEGY_RANK0_BROADCAST,
                                                              pb::STRATEGY_P2P_NO_DEDUP)));

// ------------------------------------------------------------------ presets on a tiny Qwen2
constexpr char kTinyQwen2[] = R"({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,
  "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
  "vocab_size":256,"tie_word_embeddings":false})";

class PresetTest : public ::testing::TestWithParam<pb::Strategy> {};

// Megatron TP=2 trainers (one per node) -> vLLM TP=1 x 4 replicas (two per node), one-step-off.
TEST_P(PresetTest, MegatronToVllmByteExact) {
  const pb::Strategy strategy = GetParam();
  auto config = planner::ParseHfConfig(kTinyQwen2);
  ASSERT_TRUE(config.ok()) << config.status();
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec;
  spec.set_model_id("qwen");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(4);
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  spec.set_strategy(strategy);
  std::vector<TestWorker*> trainers, rollouts;
  for (int rank = 0; rank < 2; ++rank) {
    planner::ParallelConfig pc;
    pc.preset = "megatron";
    pc.tp = 2;
    auto layout = planner::MakePresetLayout(*config, *inv, pc, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    TestWorker& w = c.AddWorker(absl::StrCat("t", rank), pb::ROLE_TRAINER, rank, &*inv, layout->layout);
    pb::ParallelConfig ppc;
    ppc.set_preset("megatron");
    ppc.set_tp(2);
    ppc.set_rank(rank);
    ASSERT_TRUE(c.Register(w, spec, &ppc).ok()) << w.id;
    trainers.push_back(&w);
  }
  for (int rank = 0; rank < 4; ++rank) {
    planner::ParallelConfig pc;
    pc.preset = "vllm";
    pc.replicas = 4;
    auto layout = planner::MakePresetLayout(*config, *inv, pc, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    TestWorker& w = c.AddWorker(absl::StrCat("r", rank), pb::ROLE_ROLLOUT, rank / 2, &*inv, layout->layout);
    pb::ParallelConfig ppc;
    ppc.set_preset("vllm");
    ppc.set_replicas(4);
    ppc.set_rank(rank);
    ASSERT_TRUE(c.Register(w, spec, &ppc).ok()) << w.id;
    rollouts.push_back(&w);
  }
  for (uint64_t v : {1u, 2u}) {
    for (auto& s : c.Publish("qwen", pb::MODE_ONE_STEP_OFF, v, trainers, rollouts)) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : rollouts) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "qwen", v, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  pb::StatusResponse status = c.Status(*rollouts[0]);
  ASSERT_EQ(status.models_size(), 1);
  const pb::PlanStats& ps = status.models(0).plan_stats();
  EXPECT_TRUE(ps.complete());
  // Every rollout needs the whole model: without dedup node n1 receives it twice over the network.
  int64_t model_bytes = 0;
  for (const planner::TensorSpec& t : inv->tensors) model_bytes += planner::BoxVolume(planner::FullBox(t.shape)) * 2;
  if (strategy == pb::STRATEGY_WEIGHTBRIDGE) {
    EXPECT_LE(ps.bytes_inter_node(), model_bytes);
  }
  if (strategy == pb::STRATEGY_P2P_NO_DEDUP) {
    EXPECT_GT(ps.bytes_inter_node(), model_bytes);
  }
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Strategies, PresetTest,
                         ::testing::Values(pb::STRATEGY_WEIGHTBRIDGE, pb::STRATEGY_RANK0_BROADCAST, pb::STRATEGY_P2P_NO_DEDUP));

// Sync mode, Megatron TP=2 trainers on n0 -> vLLM TP=1 x 2 replicas on n1: n1 receives the model
// once and relays it to its second replica. Those relays are left to the commit, which copies them
// from the first replica's staging straight into the second's live buffers; every byte must still
// be exact, and from the second version on the staging comes from the pool.
TEST(SyncRelayTest, RelaysLeftToTheCommitAreByteExactAndStagingIsReused) {
  auto config = planner::ParseHfConfig(kTinyQwen2);
  ASSERT_TRUE(config.ok()) << config.status();
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  auto scrape = [&] {
    auto m = ScrapeMetrics((*endpoint)->port(), absl::Seconds(10));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : std::map<std::string, double>{};
  };
  const auto before = scrape();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec;
  spec.set_model_id("qwen-sync");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(2);
  spec.set_mode(pb::MODE_SYNC);
  spec.set_strategy(pb::STRATEGY_WEIGHTBRIDGE);
  std::vector<TestWorker*> trainers, rollouts;
  for (int rank = 0; rank < 2; ++rank) {
    planner::ParallelConfig pc;
    pc.preset = "megatron";
    pc.tp = 2;
    auto layout = planner::MakePresetLayout(*config, *inv, pc, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    TestWorker& w = c.AddWorker(absl::StrCat("t", rank), pb::ROLE_TRAINER, 0, &*inv, layout->layout);
    pb::ParallelConfig ppc;
    ppc.set_preset("megatron");
    ppc.set_tp(2);
    ppc.set_rank(rank);
    ASSERT_TRUE(c.Register(w, spec, &ppc).ok()) << w.id;
    trainers.push_back(&w);
  }
  for (int rank = 0; rank < 2; ++rank) {
    planner::ParallelConfig pc;
    pc.preset = "vllm";
    pc.replicas = 2;
    auto layout = planner::MakePresetLayout(*config, *inv, pc, rank);
    ASSERT_TRUE(layout.ok()) << layout.status();
    TestWorker& w = c.AddWorker(absl::StrCat("r", rank), pb::ROLE_ROLLOUT, 1, &*inv, layout->layout);
    pb::ParallelConfig ppc;
    ppc.set_preset("vllm");
    ppc.set_replicas(2);
    ppc.set_rank(rank);
    ASSERT_TRUE(c.Register(w, spec, &ppc).ok()) << w.id;
    rollouts.push_back(&w);
  }
  for (uint64_t v : {1u, 2u, 3u}) {
    for (auto& s : c.Publish("qwen-sync", pb::MODE_SYNC, v, trainers, rollouts)) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : rollouts) {
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;  // live at commit, before any Apply
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "qwen-sync", v, &resp);  // sync: nothing left to copy
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v << " after Apply";
    }
  }
  c.Stop();
  const auto after = scrape();
  auto grew = [&](const std::string& name, const std::string& labels) {
    return MetricSum(after, name, labels) - MetricSum(before, name, labels);
  };
  // The model is ~0.1 MB; three versions relay (most of) it to the second replica.
  EXPECT_GT(grew("wb_relay_at_commit_bytes_total", "node=\"n1\""), 0);
  EXPECT_GT(grew("wb_staging_bytes_total", "result=\"reused\""), 0);
}

// ------------------------------------------------------------------ faults
// Node n1 freezes while version 2 is mid-transfer (its executor hangs in bucket 0, its heartbeats
// stop): its lease expires, the version is aborted, the rollout on n0 still holds version 1 byte
// for byte and its waiter gets ABORTED. When n1 thaws it re-registers (new incarnation), its
// workers register again and version 3 goes through.
TEST(FaultTest, LeaseExpiresMidTransferAbortsAndKeepsPrevious) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Milliseconds(600));
  absl::Notification entered, release;
  std::atomic<bool> frozen{false};
  c.StartNode(0);
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2) return;
    frozen = true;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  }, [&] { return frozen.load(); });
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r0, "m", 1, &resp).ok());
  ASSERT_EQ(CountBad(r0, 1), 0);

  // Version 2: publishes return (one-step-off), the transfer starts, n1 freezes in it.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  grpc::Status s = c.Apply(r0, "m", 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("node n1 lost its lease"), std::string::npos) << s.error_message();
  EXPECT_EQ(CountBad(r0, 1), 0) << "rollout weights must still be exactly version 1";
  {
    pb::StatusResponse status = c.Status(r0);
    bool saw_aborted = false;
    for (const pb::VersionStatus& v : status.versions()) {
      if (v.version() == 2) saw_aborted = v.state() == "aborted";
    }
    EXPECT_TRUE(saw_aborted);
    for (const pb::NodeStatus& n : status.nodes()) {
      if (n.node_id() == "n1") {
        EXPECT_FALSE(n.alive()) << "n1 must have lost its lease";
      }
    }
  }
  // Thaw: n1's executor fails on the torn-down channel, its next heartbeat is refused and it
  // registers again; its workers re-register (as clients do after NOT_FOUND) and v3 succeeds.
  frozen = false;
  release.Notify();
  // The node re-registers within a heartbeat; until then the coordinator refuses JoinWorker
  // (node not alive). Wait for the re-registration on the coordinator's status push.
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        for (const pb::NodeStatus& n : st.nodes()) {
          if (n.node_id() == "n1") return n.alive();
        }
        return false;
      },
      absl::Seconds(10));
  ASSERT_TRUE(back.ok()) << "n1 did not register again: " << back.status();
  for (TestWorker* w : {&t1, &r1}) {
    grpc::Status reg = c.Register(*w, spec);
    ASSERT_TRUE(reg.ok()) << w->id << ": " << reg.error_message();
  }
  for (auto& st : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(st.ok()) << st.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 3, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  c.Stop();
}

// The coordinator restarts (new process state) while version 2 is in flight: nodes notice the new
// instance, abort the version locally (waiters: ABORTED naming the restart; rollouts keep version 1
// byte for byte), re-submit models, workers and layouts, and version 3 succeeds with the same
// worker processes and connections (no worker registers again).
TEST(FaultTest, CoordinatorRestartRebuildsStateFromNodes) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  absl::Notification entered, release;
  c.StartNode(0, [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 1, &resp).ok()) << r->id;
    ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  // Version 2 is in flight (n0's executor holds it) when the coordinator goes away.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  grpc::Status apply_status, wait_status;
  std::thread applier([&] {
    pb::ApplyResponse r;
    apply_status = c.Apply(r1, "m", 2, &r);
  });
  std::thread waiter([&] {
    grpc::ClientContext ctx;
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_version(2);
    req.set_timeout_ms(20000);
    pb::WaitVersionResponse r;
    wait_status = t1.stub->WaitVersion(&ctx, req, &r);
  });
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  applier.join();
  waiter.join();
  release.Notify();
  for (const grpc::Status* s : {&apply_status, &wait_status}) {
    EXPECT_EQ(s->error_code(), grpc::StatusCode::ABORTED) << (s == &apply_status ? "Apply: " : "WaitVersion: ") << s->error_message();
    EXPECT_NE(s->error_message().find("coordinator restarted"), std::string::npos) << s->error_message();
  }
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 1), 0) << r->id << " must still hold exactly version 1";
  // Version 3 with the same workers: publishes wait for the re-plan, the transfer succeeds.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 3, &resp).ok()) << r->id;
    EXPECT_EQ(resp.applied_version(), 3u);
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 3).ok());
  pb::StatusResponse status = c.Status(r0);
  ASSERT_EQ(status.models_size(), 1);
  EXPECT_EQ(status.models(0).committed_version(), 3u);
  EXPECT_EQ(status.workers_size(), 4) << "every worker re-joined through its node";
  // Version 1 (committed before the restart, reported by the nodes) cannot be published again.
  grpc::ClientContext ctx;
  pb::PublishRequest old;
  old.set_model_id("m");
  old.set_worker_id("t0");
  old.set_version(1);
  old.set_timeout_ms(5000);
  pb::PublishResponse presp;
  EXPECT_EQ(t0.stub->Publish(&ctx, old, &presp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  c.Stop();
}

// An executor started by a previous coordinator process may report after the restart, possibly
// about a version number the new coordinator is running again. Such a ReportDone names the old
// coordinator instance and must not abort (or complete) the new coordinator's version.
TEST(FaultTest, StaleReportDoneFromBeforeRestartIsIgnored) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  absl::Notification entered, release;
  c.StartNode(0, [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || entered.HasBeenNotified()) return;  // hold the first batch of version 1
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Version 1 is held mid-transfer on n0. Failure reports about it from a stale executor (another
  // coordinator instance) arrive first.
  auto coord = pb::CoordinatorService::NewStub(grpc::CreateChannel(c.coord_->address(), grpc::InsecureChannelCredentials()));
  for (const char* node : {"n0", "n1"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::ReportDoneRequest req;
    req.set_node_id(node);
    req.set_model_id("m");
    req.set_version(1);
    req.set_ok(false);
    req.set_error("transfer failed in an executor of the previous coordinator");
    req.set_coordinator_instance("previous-coordinator-instance");
    pb::ReportDoneResponse resp;
    EXPECT_TRUE(coord->ReportDone(&ctx, req, &resp).ok());
  }
  release.Notify();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = c.Apply(*r, "m", 1, &resp);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(resp.applied_version(), 1u);
    EXPECT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 1).ok());
  c.Stop();
}

// A CUDA IPC buffer on a node without a cuda_ipc transport (no GPU here) is refused clearly at
// RegisterLayout and changes nothing (the worker can still register host memory).
TEST(FaultTest, CudaBufferWithoutGpuIsRefusedClearly) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  grpc::ClientContext c1;
  pb::RegisterWorkerRequest rw;
  rw.set_model_id("m");
  rw.set_worker_id("t0");
  rw.set_role(pb::ROLE_TRAINER);
  rw.set_gpu(0);
  rw.set_pid(::getpid());
  *rw.mutable_model() = spec;
  pb::RegisterWorkerResponse rwr;
  ASSERT_TRUE(t0.stub->RegisterWorker(&c1, rw, &rwr).ok());
  grpc::ClientContext c2;
  pb::RegisterLayoutRequest rl;
  rl.set_model_id("m");
  rl.set_worker_id("t0");
  pb::BufferSpec* b = rl.add_buffers();
  b->set_buffer_id(3);
  b->set_size_bytes(1024);
  b->set_cuda_ipc_handle(std::string(64, '\x01'));
  b->set_gpu(0);
  // Explicit pieces (a preset on this explicit-tensor model is refused before buffers are opened).
  for (const planner::Piece& p : t0.layout.pieces) {
    pb::Piece* pp = rl.mutable_layout()->mutable_pieces()->add_pieces();
    pp->set_tensor(inv.tensors[p.tensor].name);
    ToProto(p.box, pp->mutable_box());
    pp->set_buffer_id(3);
    pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
    for (int64_t st : p.strides) pp->add_strides(st);
  }
  pb::RegisterLayoutResponse rlr;
  grpc::Status s = t0.stub->RegisterLayout(&c2, rl, &rlr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("buffer 3"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("no cuda_ipc transport"), std::string::npos) << s.error_message();
  c.Stop();
}

// A worker process that dies without Deregister (kill -9) is noticed through its pid: the model
// is re-planned without it.
TEST(FaultTest, DeadWorkerProcessIsDropped) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(2);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c.Register(t0, spec).ok());
  ASSERT_TRUE(c.Register(r0, spec).ok());
  // A second rollout "process": a child that only sleeps; we register it (layout included, so it
  // is in the plan) with the child's pid, then kill -9 it.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}}));
  ASSERT_TRUE(c.Register(r1, spec, nullptr, child).ok());
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 1, {&t0}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  {
    pb::ApplyResponse resp;
    ASSERT_TRUE(c.Apply(r1, "m", 1, &resp).ok());
    EXPECT_EQ(CountBad(r1, 1), 0);
  }
  auto has_r1 = [&] {
    pb::StatusResponse st = c.Status(r0);
    for (const pb::WorkerStatus& w : st.workers()) if (w.worker_id() == "r1") return true;
    return false;
  };
  EXPECT_TRUE(has_r1());
  ::kill(child, SIGKILL);
  int wstatus = 0;
  ::waitpid(child, &wstatus, 0);
  // Heartbeats (100 ms) check worker processes; the node tells the coordinator (LeaveWorker).
  // Wait for the drop on the coordinator's status push (the status r0's node forwards).
  auto dropped = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        for (const pb::WorkerStatus& w : st.workers()) if (w.worker_id() == "r1") return false;
        return true;
      },
      absl::Seconds(10));
  EXPECT_TRUE(dropped.ok()) << "worker r1 (pid " << child << ") was not dropped: " << dropped.status();
  EXPECT_FALSE(has_r1());
  // Re-planned without it: the remaining pair still moves versions.
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 2, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r0, "m", 2, &resp).ok());
  EXPECT_EQ(CountBad(r0, 2), 0);
  c.Stop();
}


int CountOpenFds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

// A peer node that restarts (new process = new transport instance) must not leave the surviving
// node holding the old incarnation's data channel: it was once replaced in the channel cache
// without being disconnected, leaking its sockets on every restart (found by the soak test).
TEST(FaultTest, PeerRestartsDoNotLeakChannels) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  // Trainers split `a` across the nodes, so every version has cross-node ops (a data channel).
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  auto run_version = [&](uint64_t v) {
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << "version " << v << ": " << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " version " << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  };
  run_version(1);
  run_version(2);  // channels cached and reused: the steady state
  const int fds0 = CountOpenFds();
  constexpr int kRestarts = 6;
  for (int k = 0; k < kRestarts; ++k) {
    c.nodes_[1]->Shutdown();
    c.nodes_[1].reset();
    c.StartNode(1);
    ASSERT_TRUE(c.nodes_[1]) << "restart " << k;
    // r1 first, then t1: the model cannot re-plan before both trainers are back, so the next
    // version's plan includes n1 again (cross-node channel needed).
    for (TestWorker* w : {&r1, &t1}) {
      c.Connect(*w);
      grpc::Status s = c.Register(*w, spec);
      ASSERT_TRUE(s.ok()) << w->id << " after restart " << k << ": " << s.error_message();
    }
    run_version(3 + k);
  }
  const int fds1 = CountOpenFds();
  // Every restart used to leave n0 with the old channel's streams open (>= 1 fd each).
  EXPECT_LE(fds1, fds0 + kRestarts / 2) << "open fds " << fds0 << " -> " << fds1 << " after " << kRestarts << " restarts of n1";
  c.Stop();
}

// Virtual memory of this process in KiB. A thread that has finished but was never joined is gone
// from /proc/self/task, yet its stack (8 MiB by default) stays mapped until it is joined.
int64_t VmSizeKiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7));
  }
  return -1;
}

// Every version runs on an executor thread per node. They used to be kept (unjoined) until
// shutdown, so a long-running daemon grew by one thread stack per version; finished ones are now
// joined as new versions start.
TEST(FaultTest, ExecutorThreadsDoNotAccumulate) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  int64_t vm_after_warmup = 0;
  constexpr uint64_t kWarmup = 5, kVersions = 35;
  for (uint64_t v = 1; v <= kVersions; ++v) {
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << "version " << v << ": " << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " version " << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
    if (v == kWarmup) vm_after_warmup = VmSizeKiB();
  }
  const int64_t vm_end = VmSizeKiB();
  ASSERT_GT(vm_after_warmup, 0);
  // Unjoined executors would pin 2 nodes x 30 versions x >= 8 MiB of stacks; allow 10 stacks.
  EXPECT_LE(vm_end, vm_after_warmup + 10 * 8 * 1024)
      << "VmSize " << vm_after_warmup << " KiB -> " << vm_end << " KiB over " << kVersions - kWarmup << " versions";
  c.Stop();
}

uint64_t CommittedOf(const pb::StatusResponse& st, const std::string& model) {
  for (const pb::ModelStatus& m : st.models()) {
    if (m.model_id() == model) return m.committed_version();
  }
  return 0;
}

// The coordinator's status push (CoordinatorService.WatchStatus, through the daemon's auth/limit
// front): the first message comes at once, a commit is pushed as it happens (the safety-net resend
// is set to 30 s here, so nothing but the change signal can deliver it in time), a stream ends OK
// at its deadline, watchers over the limit get RESOURCE_EXHAUSTED, a cancelled client frees its
// slot, and Shutdown ends an open stream promptly with UNAVAILABLE.
TEST(StatusPushTest, PushesChangesHonoursDeadlineLimitCancelAndShutdown) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) {
    o.security.limits.max_status_watchers = 2;
    o.status_resend = absl::Seconds(30);
  });
  c.StartNode(0);
  c.StartNode(1);
  Coordinator* coordinator = c.coord_->coordinator();
  ASSERT_NE(coordinator, nullptr);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(r0, "m", 1).ok());

  auto channel = grpc::CreateChannel(c.coord_->address(), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5)));
  auto stub = pb::CoordinatorService::NewStub(channel);
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<pb::StatusResponse>> reader;
  };
  auto open = [&](int64_t timeout_ms) {
    auto s = std::make_unique<Stream>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    pb::WatchStatusRequest req;
    req.set_timeout_ms(timeout_ms);
    s->reader = stub->WatchStatus(&s->ctx, req);
    return s;
  };

  // First message at once (nothing changes meanwhile: the 30 s resend would be the only other
  // source), then a commit pushes its status as it happens.
  {
    const absl::Time opened = absl::Now();
    auto w = open(20000);
    pb::StatusResponse msg;
    ASSERT_TRUE(w->reader->Read(&msg));
    EXPECT_LT(absl::Now() - opened, absl::Seconds(5));
    EXPECT_EQ(msg.role(), "coordinator");
    EXPECT_EQ(CommittedOf(msg, "m"), 1u);
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(WaitCommitted(r0, "m", 2).ok());
    const absl::Time committed = absl::Now();
    int messages = 1;
    bool seen = false;
    while (!seen && w->reader->Read(&msg)) {
      ++messages;
      seen = CommittedOf(msg, "m") == 2;
    }
    ASSERT_TRUE(seen) << "the commit of version 2 was not pushed";
    const absl::Duration lag = absl::Now() - committed;
    EXPECT_LT(lag, absl::Milliseconds(500)) << "commit pushed " << lag << " after WaitVersion returned";
    EXPECT_GE(messages, 3) << "publish / transfer steps should have been pushed before the commit";
    w->ctx.TryCancel();
    (void)w->reader->Finish();
  }
  // The cancelled stream's slot comes back.
  ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(0, absl::Now() + absl::Seconds(5)));

  // A stream ends OK at its deadline and frees its slot.
  {
    const absl::Time opened = absl::Now();
    auto w = open(300);
    pb::StatusResponse msg;
    int messages = 0;
    while (w->reader->Read(&msg)) ++messages;
    grpc::Status end = w->reader->Finish();
    const absl::Duration took = absl::Now() - opened;
    EXPECT_TRUE(end.ok()) << end.error_message();
    EXPECT_GE(messages, 1);
    EXPECT_GE(took, absl::Milliseconds(290));
    EXPECT_LT(took, absl::Seconds(5));
    ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(0, absl::Now() + absl::Seconds(5)));
  }

  // Limit 2: a third watcher is refused; cancelling one lets the next in.
  {
    auto a = open(20000), b = open(20000);
    pb::StatusResponse msg;
    ASSERT_TRUE(a->reader->Read(&msg));
    ASSERT_TRUE(b->reader->Read(&msg));
    auto refused = open(20000);
    EXPECT_FALSE(refused->reader->Read(&msg));
    grpc::Status st = refused->reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_NE(st.error_message().find("max_status_watchers"), std::string::npos) << st.error_message();
    a->ctx.TryCancel();
    (void)a->reader->Finish();
    ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(1, absl::Now() + absl::Seconds(5)))
        << "a cancelled watcher did not free its slot";
    auto next = open(20000);
    EXPECT_TRUE(next->reader->Read(&msg)) << next->reader->Finish().error_message();

    // Shutdown ends open streams at once with UNAVAILABLE (and is not held up by them).
    std::atomic<bool> ended{false};
    grpc::Status shut_status;
    std::thread reader([&] {
      pb::StatusResponse m;
      while (b->reader->Read(&m)) {}
      shut_status = b->reader->Finish();
      ended = true;
    });
    const absl::Time shutdown_start = absl::Now();
    c.coord_->Shutdown();
    const absl::Duration shutdown_took = absl::Now() - shutdown_start;
    reader.join();
    EXPECT_LT(shutdown_took, absl::Seconds(1.5)) << "the server's 2 s grace ran out: a stream held Shutdown up";
    EXPECT_TRUE(ended.load());
    EXPECT_EQ(shut_status.error_code(), grpc::StatusCode::UNAVAILABLE) << shut_status.error_message();
    while (next->reader->Read(&msg)) {}
    EXPECT_EQ(next->reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  c.Stop();
}

// ------------------------------------------------------------------ live weights: whole or TORN
// (issue 15 items 1-3; docs/daemon.md "Live weights: whole or TORN")

// The status of worker `id` as its own node reports it.
pb::WorkerStatus LocalStatus(Cluster& c, TestWorker& w) {
  const pb::StatusResponse status = c.Status(w);
  for (const pb::WorkerStatus& ws : status.workers()) {
    if (ws.worker_id() == w.id) return ws;
  }
  return pb::WorkerStatus();
}

grpc::Status ApplyWithin(TestWorker& r, uint64_t v, int64_t timeout_ms, pb::ApplyResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  pb::ApplyRequest req;
  req.set_model_id("m");
  req.set_worker_id(r.id);
  req.set_version(v);
  req.set_timeout_ms(timeout_ms);
  return r.stub->Apply(&ctx, req, resp);
}

// A live copy that has started is not cut short by the client's deadline: the copy into r0 is
// held 300 ms before it posts (as a slow copy would be), past the call's 200 ms timeout, and the
// answer is OK with the whole version. Before: the copy waited with the client's deadline, was
// cancelled, and Apply answered DEADLINE_EXCEEDED with live memory part new, part old.
TEST(TornTest, ApplyDeadlineDoesNotCutAStartedCopy) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_live_copy_fault = [&](const std::string& label) {
        if (label == "apply r0 v2") absl::SleepFor(absl::Milliseconds(300));  // a slow copy, not a wait for a condition
        return absl::OkStatus();
      };
    };
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (uint64_t v : {1, 2}) {
    for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(WaitCommitted(r1, "m", v).ok());
    grpc::Status s = ApplyWithin(r0, v, 200, &resp);
    ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    EXPECT_EQ(resp.applied_version(), v);
    EXPECT_EQ(CountBad(r0, v), 0) << "v" << v << " must be whole in live memory";
  }
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
  c.Stop();
}

// Apply(v, 1 ms) for a committed 16 MiB version: the copy cannot fit in what is left of the call's
// timeout, so it is not started: DEADLINE_EXCEEDED saying nothing was copied, live weights whole
// (the previous version); a later Apply with time to spare applies it whole. Before: the copy
// started, was cancelled at 1 ms and left live memory part new, part old.
TEST(TornTest, ApplyThatCannotFitItsTimeoutTouchesNothing) {
  planner::Inventory inv;
  inv.tensors = {{"a", {2048, 2048}, planner::DType::kF32}};
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec;
  spec.set_model_id("m");
  pb::TensorSpec* ts = spec.mutable_explicit_tensors()->add_tensors();
  ts->set_name("a");
  ts->add_shape(2048);
  ts->add_shape(2048);
  ts->set_dtype(pb::DTYPE_F32);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  spec.set_strategy(pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {2048, 2048}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {2048, 2048}, false}}));
  for (TestWorker* w : {&t0, &r0}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (uint64_t v : {1, 2}) {
    for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, v, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(WaitCommitted(r0, "m", v).ok());
    grpc::Status s = ApplyWithin(r0, v, 1, &resp);
    if (s.ok()) {
      EXPECT_EQ(CountBad(r0, v), 0) << "v" << v << ": OK must mean whole";
      continue;
    }
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_NE(s.error_message().find("nothing was copied"), std::string::npos) << s.error_message();
    if (v > 1) {
      EXPECT_EQ(CountBad(r0, v - 1), 0) << "live weights must still be whole version " << v - 1;
    }
    EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
    s = ApplyWithin(r0, v, 20000, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(CountBad(r0, v), 0);
  }
  c.Stop();
}

// A live copy that fails midway (one-step-off Apply): the rollout is told its weights are TORN
// (which version over which, why), Status and WaitVersion on its node say so, and the next Apply
// restores the whole version.
TEST(TornTest, FailedApplyCopyIsReportedTornAndTheNextApplyRestores) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  std::atomic<int> faults{1};
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_live_copy_fault = [&](const std::string& label) {
        return label == "apply r0 v2" && faults.fetch_sub(1) > 0 ? absl::UnavailableError("injected transport failure") : absl::OkStatus();
      };
    };
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(c.Apply(r0, "m", 1, &resp).ok());
  ASSERT_EQ(CountBad(r0, 1), 0);
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(r1, "m", 2).ok());

  grpc::Status s = c.Apply(r0, "m", 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  for (const char* want : {"worker r0", "node n0", "TORN", "version 2", "over version 1", "injected transport failure"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  EXPECT_GT(CountBad(r0, 1), 0) << "the fault let half the pieces land";
  EXPECT_GT(CountBad(r0, 2), 0);
  pb::WorkerStatus ws = LocalStatus(c, r0);
  EXPECT_EQ(ws.live_state(), "torn");
  EXPECT_EQ(ws.live_writing_version(), 2u);
  EXPECT_EQ(ws.live_over_version(), 1u);
  EXPECT_NE(ws.live_detail().find("TORN"), std::string::npos) << ws.live_detail();
  grpc::Status w = WaitCommitted(r0, "m", 2);
  EXPECT_EQ(w.error_code(), grpc::StatusCode::DATA_LOSS) << "WaitVersion must not report a version r0 does not hold: " << w.error_message();

  ASSERT_TRUE(c.Apply(r0, "m", 2, &resp).ok()) << "the next Apply restores a whole version";
  EXPECT_EQ(resp.applied_version(), 2u);
  EXPECT_EQ(CountBad(r0, 2), 0);
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
  EXPECT_TRUE(WaitCommitted(r0, "m", 2).ok());
  c.Stop();
}

// Sync: the commit's live copy into r0 fails midway. The node's CommitVersion fails naming the
// rollout, r0's WaitVersion says TORN instead of OK, and r0's Apply copies the committed staging
// again (whole); version 3 then commits normally.
TEST(TornTest, FailedSyncCommitCopyNamesTheRolloutAndApplyRestores) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  std::atomic<int> faults{1};
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_live_copy_fault = [&](const std::string& label) {
        return label == "commit r0 v2" && faults.fetch_sub(1) > 0 ? absl::UnavailableError("injected transport failure") : absl::OkStatus();
      };
    };
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(r0, 1), 0);
  (void)c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1});  // the coordinator's answer is COORD's (issue 15.2)
  // Not OK: DATA_LOSS from r0's node, or the coordinator's own refusal of the version (ABORTED
  // naming the node's error) once it counts a sync version only when every rollout holds it.
  grpc::Status w = WaitCommitted(r0, "m", 2);
  EXPECT_FALSE(w.ok());
  EXPECT_NE(w.error_message().find("worker r0 on node n0 are TORN"), std::string::npos) << w.error_message();
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "torn");
  EXPECT_EQ(CountBad(r1, 2), 0) << "r1's node committed normally";
  pb::ApplyResponse resp;
  grpc::Status a = c.Apply(r0, "m", 2, &resp);
  ASSERT_TRUE(a.ok()) << a.error_message();
  EXPECT_EQ(CountBad(r0, 2), 0);
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  c.Stop();
}

// NodeService.CommitVersion for a version still arriving on the node is FAILED_PRECONDITION naming
// model, version and what is missing; the version then completes normally. Before: OK, and the
// rollout's Apply got a version with most of its bytes missing.
TEST(TornTest, CommitOfAVersionNotFullyLandedIsRefused) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  absl::Notification entered, release;
  c.StartNode(0);
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t bucket) {
    if (version != 2 || bucket != 0) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  });
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  auto node = pb::NodeService::NewStub(grpc::CreateChannel(c.nodes_[1]->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::CommitVersionRequest req;
  req.set_model_id("m");
  req.set_version(2);
  pb::CommitVersionResponse cr;
  grpc::Status s = node->CommitVersion(&ctx, req, &cr);
  release.Notify();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  for (const char* want : {"model m", "version 2", "node n1", "not fully landed", "still running"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r1, "m", 2, &resp).ok());
  EXPECT_EQ(resp.applied_version(), 2u);
  EXPECT_EQ(CountBad(r1, 2), 0);
  c.Stop();
}

// ------------------------------------------------------------------ hostile worker memory
// (issue 15 items 4, 9 and 15's segment mode)

absl::Status TruncateSegment(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return absl::InternalError("shm_open");
  const int rc = ::ftruncate(fd, 0);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : absl::InternalError("ftruncate");
}

// A rollout truncates its own segment while the node copies a version into it (here: right after
// the node checked it, before the copy's first byte): the daemon survives the SIGBUS, only that
// rollout gets an error (naming it and its buffer), and the other rollout keeps receiving versions.
// A trainer that truncates its segment before Publish gets an error naming it and its buffer.
// Before: the node daemon (here: this test process) died of SIGBUS.
TEST(HostileMemoryTest, WorkerTruncatingItsSegmentFailsOnlyThatWorker) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  std::string r0_segment;
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_live_copy_fault = [&](const std::string& label) {
        if (label == "apply r0 v2") {
          EXPECT_TRUE(TruncateSegment(r0_segment).ok());
        }
        return absl::OkStatus();
      };
    };
  });
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  r0_segment = r0.seg.name();
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (uint64_t v : {1, 2}) {
    for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(c.Apply(r1, "m", v, &resp).ok());
    EXPECT_EQ(CountBad(r1, v), 0);
  }
  // r0's memory is gone from here on: never read it (this process would fault on it).
  grpc::Status s = c.Apply(r0, "m", 2, &resp);
  EXPECT_FALSE(s.ok());
  for (const char* want : {"r0", "live buffer 0", r0_segment.c_str(), "shrank"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "torn");
  // Refused before writing now (the segment is known bad), still naming it.
  s = c.Apply(r0, "m", 2, &resp);
  EXPECT_NE(s.error_message().find("live buffer 0"), std::string::npos) << s.error_message();
  // Everyone else goes on: version 3 reaches r1 byte for byte.
  for (auto& st : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(c.Apply(r1, "m", 3, &resp).ok());
  EXPECT_EQ(CountBad(r1, 3), 0);
  // A trainer that truncated its memory before Publish: the snapshot is refused, naming it.
  ASSERT_TRUE(TruncateSegment(t0.seg.name()).ok());
  {
    grpc::ClientContext ctx;
    pb::PublishRequest req;
    req.set_model_id("m");
    req.set_worker_id("t0");
    req.set_version(4);
    req.set_timeout_ms(10000);
    pb::PublishResponse presp;
    grpc::Status p = t0.stub->Publish(&ctx, req, &presp);
    EXPECT_EQ(p.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << p.error_message();
    for (const char* want : {"snapshot t0 v4", "live buffer 0", "shrank to 0 bytes"}) {
      EXPECT_NE(p.error_message().find(want), std::string::npos) << want << " missing in: " << p.error_message();
    }
  }
  c.Stop();
}

// A FIFO named as a worker's segment is refused at once (it hung RegisterLayout forever), and a
// segment with group/other access (mode 0666) is refused naming its mode.
TEST(HostileMemoryTest, FifoAndOpenModeSegmentsAreRefusedAtOnce) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  {
    grpc::ClientContext ctx;
    pb::RegisterWorkerRequest rw;
    rw.set_model_id("m");
    rw.set_worker_id("r0");
    rw.set_role(pb::ROLE_ROLLOUT);
    rw.set_gpu(-1);
    *rw.mutable_model() = spec;
    pb::RegisterWorkerResponse rwr;
    ASSERT_TRUE(r0.stub->RegisterWorker(&ctx, rw, &rwr).ok());
  }
  auto register_layout = [&](const std::string& shm, uint64_t size) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::RegisterLayoutRequest rl;
    rl.set_model_id("m");
    rl.set_worker_id("r0");
    pb::BufferSpec* b = rl.add_buffers();
    b->set_buffer_id(7);
    b->set_size_bytes(size);
    b->set_shm_name(shm);
    b->set_gpu(-1);
    for (const planner::Piece& p : r0.layout.pieces) {
      pb::Piece* pp = rl.mutable_layout()->mutable_pieces()->add_pieces();
      pp->set_tensor(inv.tensors[p.tensor].name);
      ToProto(p.box, pp->mutable_box());
      pp->set_buffer_id(7);
      pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
      for (int64_t st : p.strides) pp->add_strides(st);
    }
    pb::RegisterLayoutResponse rlr;
    return r0.stub->RegisterLayout(&ctx, rl, &rlr);
  };
  const std::string fifo = transport::ShmSegment::UniqueName("fifo");
  ASSERT_EQ(::mkfifo(("/dev/shm" + fifo).c_str(), 0600), 0);
  const absl::Time t0 = absl::Now();
  grpc::Status s = register_layout(fifo, 64);
  ::unlink(("/dev/shm" + fifo).c_str());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << "must not hang";
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("FIFO"), std::string::npos) << s.error_message();
  ASSERT_EQ(::chmod(("/dev/shm" + r0.seg.name()).c_str(), 0666), 0);
  s = register_layout(r0.seg.name(), static_cast<uint64_t>(r0.seg.size()));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("mode 0666"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("r0"), std::string::npos) << s.error_message();
  c.Stop();
}

// ------------------------------------------------------------------ worker-binding races (issue 15.14)

// Publish racing Deregister + RegisterWorker of the same worker id (same process: allowed) must
// answer with a status that names the problem, never UNKNOWN "Unexpected error in RPC handling"
// (the front read the worker's binding after releasing its lock; Deregister had erased it).
TEST(RaceTest, PublishRacingReRegistrationNeverAnswersUnknown) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c.Register(t0, spec).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> unknown{0}, publishes{0}, cycles{0};
  std::string example;
  absl::Mutex example_mu;
  std::vector<std::thread> publishers;
  for (int k = 0; k < 4; ++k) {
    publishers.emplace_back([&, k] {
      auto stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", c.nodes_[0]->worker_socket()),
                                                                 grpc::InsecureChannelCredentials()));
      for (uint64_t v = 1 + k * 100000; !stop.load(); ++v) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        pb::PublishRequest req;
        req.set_model_id("m");
        req.set_worker_id("t0");
        req.set_version(v);
        req.set_timeout_ms(1);
        pb::PublishResponse resp;
        grpc::Status s = stub->Publish(&ctx, req, &resp);
        publishes++;
        if (s.error_code() == grpc::StatusCode::UNKNOWN || s.error_code() == grpc::StatusCode::INTERNAL) {
          unknown++;
          absl::MutexLock l(&example_mu);
          example = s.error_message();
        }
      }
    });
  }
  const absl::Time end = absl::Now() + absl::Seconds(8);
  while (absl::Now() < end) {
    grpc::ClientContext c1;
    pb::DeregisterRequest d;
    d.set_model_id("m");
    d.set_worker_id("t0");
    pb::DeregisterResponse dr;
    (void)t0.stub->Deregister(&c1, d, &dr);
    grpc::ClientContext c2;
    pb::RegisterWorkerRequest rw;
    rw.set_model_id("m");
    rw.set_worker_id("t0");
    rw.set_role(pb::ROLE_TRAINER);
    rw.set_gpu(-1);
    rw.set_pid(::getpid());
    *rw.mutable_model() = spec;
    pb::RegisterWorkerResponse rwr;
    (void)t0.stub->RegisterWorker(&c2, rw, &rwr);
    cycles++;
  }
  stop = true;
  for (std::thread& t : publishers) t.join();
  EXPECT_GT(cycles.load(), 10);
  EXPECT_GT(publishes.load(), 100);
  EXPECT_EQ(unknown.load(), 0) << "e.g. " << example << " (" << publishes.load() << " publishes, " << cycles.load() << " re-registrations)";
  c.Stop();
}

// ------------------------------------------------------------------ a second layout (issue 15.13)

bool CoordinatorHasLayout(const pb::StatusResponse& st, const std::string& worker) {
  for (const pb::WorkerStatus& w : st.workers()) {
    if (w.worker_id() == worker) return w.has_layout();
  }
  return false;
}

// The same layout registered again is OK and changes nothing; a different one while the worker is
// in the plan is FAILED_PRECONDITION saying why, and the worker stays registered everywhere with
// its first layout. Before: ABORTED "worker dropped concurrently", and the worker vanished from the
// coordinator while its node kept it.
TEST(LayoutAgainTest, SameLayoutIsIdempotentAndADifferentOneIsRefusedUnderAPlan) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(c.Apply(r0, "m", 1, &resp).ok());

  for (TestWorker* w : {&t0, &r0}) {
    grpc::Status s = c.RegisterLayout(*w, spec);
    EXPECT_TRUE(s.ok()) << w->id << ": the same layout again must be OK: " << s.error_message();
  }
  planner::WorkerLayout other = LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, false}});  // `a` transposed now
  std::swap(r0.layout, other);
  grpc::Status s = c.RegisterLayout(r0, spec);
  std::swap(r0.layout, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("already has a different layout"), std::string::npos) << s.error_message();
  auto st = c.WaitForCoordinator([](const pb::StatusResponse& r) { return true; }, absl::Seconds(10));
  ASSERT_TRUE(st.ok()) << st.status();
  for (const char* w : {"t0", "r0"}) EXPECT_TRUE(CoordinatorHasLayout(*st, w)) << w << " must still be registered at the coordinator";
  // Version 2 goes through on the first layouts, byte for byte.
  for (auto& p : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(p.ok()) << p.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 2, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  c.Stop();
}

// A trainer layout with a hole (no trainer holds rows 4-7 of `a` nor `b`): the model cannot plan,
// and its status says why. Before: accepted, never planned, no error anywhere.
TEST(LayoutAgainTest, TrainerLayoutWithAHoleIsReportedInStatus) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {4, 16}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  for (TestWorker* w : {&t0, &r0}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  auto st = c.WaitForCoordinator(
      [](const pb::StatusResponse& r) { return r.models_size() > 0 && !r.models(0).plan_error().empty(); }, absl::Seconds(10));
  ASSERT_TRUE(st.ok()) << "no plan error in status: " << st.status();
  const std::string& why = st->models(0).plan_error();
  EXPECT_NE(why.find("a"), std::string::npos) << why;
  c.Stop();
}

// ------------------------------------------------------------------ input rules (issue 15.12, node side)

// RegisterWorker with an unknown role, mode or strategy, a 1 MiB id or an id with CR/LF: a short
// INVALID_ARGUMENT naming the field (the caller sees the message, not gRPC's "metadata size
// exceeds limit"), and nothing is registered. Before: role/mode/strategy 99 were accepted.
TEST(InputRulesTest, RegisterWorkerRefusesBadEnumsAndIdsNamingTheField) {
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  auto stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", c.nodes_[0]->worker_socket()), grpc::InsecureChannelCredentials()));
  auto attempt = [&](const std::function<void(pb::RegisterWorkerRequest&)>& edit) {
    pb::RegisterWorkerRequest rw;
    rw.set_model_id("m");
    rw.set_worker_id("w");
    rw.set_role(pb::ROLE_TRAINER);
    rw.set_gpu(-1);
    *rw.mutable_model() = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
    edit(rw);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::RegisterWorkerResponse resp;
    return stub->RegisterWorker(&ctx, rw, &resp);
  };
  struct Case {
    const char* what;
    std::function<void(pb::RegisterWorkerRequest&)> edit;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"role 99", [](pb::RegisterWorkerRequest& r) { r.set_role(static_cast<pb::Role>(99)); }, "role is 99"},
      {"role unset", [](pb::RegisterWorkerRequest& r) { r.set_role(pb::ROLE_UNSPECIFIED); }, "role is 0"},
      {"mode 99", [](pb::RegisterWorkerRequest& r) { r.mutable_model()->set_mode(static_cast<pb::Mode>(99)); }, "mode is 99"},
      {"strategy 99", [](pb::RegisterWorkerRequest& r) { r.mutable_model()->set_strategy(static_cast<pb::Strategy>(99)); }, "strategy is 99"},
      {"1 MiB worker id", [](pb::RegisterWorkerRequest& r) { r.set_worker_id(std::string(1 << 20, 'x')); }, "worker_id"},
      {"CR LF in worker id", [](pb::RegisterWorkerRequest& r) { r.set_worker_id("w\r\nx"); }, "worker_id"},
  };
  for (const Case& k : cases) {
    grpc::Status s = attempt(k.edit);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << k.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(k.field), std::string::npos) << k.what << ": " << s.error_message();
    EXPECT_LT(s.error_message().size(), 1024u) << k.what;
  }
  grpc::Status ok = attempt([](pb::RegisterWorkerRequest&) {});
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  c.Stop();
}

// ------------------------------------------------------------------ staging budget (issue 15, "a node total")

// --staging_budget_bytes is the node's total of host staging: with version 1's committed staging
// still held (r0 has not applied it) and version 2's snapshot taken, version 2's incoming staging
// does not fit, so version 2 is refused naming the budget (each piece alone fits: before, only the
// version's own staging was compared with the budget and the node held more than it). Once r0
// applied version 1 the memory is back and version 3 goes through.
TEST(StagingBudgetNodeTest, BudgetIsTheNodeTotal) {
  planner::Inventory inv = SmallInventory();  // 560 bytes; snapshot of a 624-byte segment
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0, nullptr, nullptr, [](ServerOptions& o) { o.staging_budget_bytes = 1500; });
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  for (TestWorker* w : {&t0, &r0}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(r0, "m", 1).ok());
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
  grpc::Status w = WaitCommitted(r0, "m", 2);
  EXPECT_EQ(w.error_code(), grpc::StatusCode::ABORTED) << w.error_message();
  for (const char* want : {"node n0", "version 2", "--staging_budget_bytes=1500", "in use"}) {
    EXPECT_NE(w.error_message().find(want), std::string::npos) << want << " missing in: " << w.error_message();
  }
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r0, "m", 0, &resp).ok());
  EXPECT_EQ(resp.applied_version(), 1u);
  EXPECT_EQ(CountBad(r0, 1), 0);
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(c.Apply(r0, "m", 3, &resp).ok());
  EXPECT_EQ(CountBad(r0, 3), 0);
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon

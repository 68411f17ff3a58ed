// Coordinator + two node daemons as objects in one process on 127.0.0.1:0, workers as gRPC clients
// on the nodes' Unix sockets with shared-memory weights: bytes must arrive byte-exact in each mode.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/server.h"
#include "daemon/simple_plan.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tools/cc/weight_gen.h"
#include "transport/shm_segment.h"

namespace wb::daemon {
namespace {

struct Tensor { const char* name; std::vector<int64_t> shape; int elem; };
const Tensor kTensors[] = {{"a", {8, 16}, 4}, {"b", {4, 6}, 2}};

struct PieceDef { int tensor; std::vector<int64_t> begin, end; bool transposed; };

struct TestWorker {
  std::string id, socket;
  pb::Role role;
  std::vector<PieceDef> pieces;
  transport::ShmSegment seg;
  std::vector<int64_t> offsets;  // per piece
  std::unique_ptr<pb::WorkerService::Stub> stub;
};

int64_t Vol(const PieceDef& p) { int64_t v = 1; for (size_t i = 0; i < p.begin.size(); ++i) v *= p.end[i] - p.begin[i]; return v; }

// Element (r, c) of piece p: row-major in the piece, or column-major when transposed.
int64_t LocalIndex(const PieceDef& p, int64_t r, int64_t c) {
  int64_t rows = p.end[0] - p.begin[0], cols = p.end[1] - p.begin[1];
  (void)rows;
  return p.transposed ? (c - p.begin[1]) * (p.end[0] - p.begin[0]) + (r - p.begin[0]) : (r - p.begin[0]) * cols + (c - p.begin[1]);
}

void Fill(TestWorker& w, uint64_t version) {
  for (size_t i = 0; i < w.pieces.size(); ++i) {
    const PieceDef& p = w.pieces[i];
    const Tensor& t = kTensors[p.tensor];
    for (int64_t r = p.begin[0]; r < p.end[0]; ++r)
      for (int64_t c = p.begin[1]; c < p.end[1]; ++c)
        WriteWeight(p.tensor, version, r * t.shape[1] + c, t.elem,
                    static_cast<uint8_t*>(w.seg.data()) + w.offsets[i] + LocalIndex(p, r, c) * t.elem);
  }
}

int64_t CountBad(const TestWorker& w, uint64_t version) {
  int64_t bad = 0;
  for (size_t i = 0; i < w.pieces.size(); ++i) {
    const PieceDef& p = w.pieces[i];
    const Tensor& t = kTensors[p.tensor];
    for (int64_t r = p.begin[0]; r < p.end[0]; ++r)
      for (int64_t c = p.begin[1]; c < p.end[1]; ++c)
        bad += !CheckWeight(p.tensor, version, r * t.shape[1] + c, t.elem,
                            static_cast<uint8_t*>(w.seg.data()) + w.offsets[i] + LocalIndex(p, r, c) * t.elem);
  }
  return bad;
}

class MultiNodeTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void SetUp() override {
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.make_plan = SimplePlan;
    co.transfer_timeout = absl::Seconds(20);
    auto c = Server::Start(co);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
    for (int n = 0; n < 2; ++n) {
      ServerOptions no;
      no.role = DaemonRole::kNode;
      no.node_id = absl::StrCat("n", n);
      no.coordinator = coord_->address();
      no.worker_socket = absl::StrCat("/tmp/wbmn-", ::getpid(), "-", n, ".sock");  // unix paths max 107 chars
      no.heartbeat = absl::Milliseconds(100);
      no.make_data_channel = [] { return NewTcpDataChannel(); };
      auto s = Server::Start(no);
      ASSERT_TRUE(s.ok()) << s.status();
      nodes_.push_back(std::move(*s));
    }
  }
  void TearDown() override {
    workers_.clear();
    for (auto& n : nodes_) n->Shutdown();
    if (coord_) coord_->Shutdown();
  }

  TestWorker& AddWorker(const std::string& id, pb::Role role, int node, std::vector<PieceDef> pieces) {
    auto w = std::make_unique<TestWorker>();
    w->id = id;
    w->role = role;
    w->pieces = std::move(pieces);
    int64_t off = 0;
    for (const PieceDef& p : w->pieces) {
      w->offsets.push_back(off);
      off += Vol(p) * kTensors[p.tensor].elem;
    }
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("mn"), off + 64);
    EXPECT_TRUE(seg.ok()) << seg.status();
    w->seg = std::move(*seg);
    w->stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", nodes_[node]->worker_socket()),
                                                             grpc::InsecureChannelCredentials()));
    workers_.push_back(std::move(w));
    return *workers_.back();
  }

  grpc::Status Register(TestWorker& w, const pb::ModelSpec& spec) {
    grpc::ClientContext c1;
    pb::RegisterWorkerRequest rw;
    rw.set_model_id(spec.model_id());
    rw.set_worker_id(w.id);
    rw.set_role(w.role);
    *rw.mutable_model() = spec;
    pb::RegisterWorkerResponse rwr;
    grpc::Status s = w.stub->RegisterWorker(&c1, rw, &rwr);
    if (!s.ok()) return s;
    pb::RegisterLayoutRequest rl;
    rl.set_model_id(spec.model_id());
    rl.set_worker_id(w.id);
    pb::BufferSpec* b = rl.add_buffers();
    b->set_buffer_id(7);
    b->set_size_bytes(static_cast<uint64_t>(w.seg.size()));
    b->set_shm_name(w.seg.name());
    b->set_gpu(-1);
    for (size_t i = 0; i < w.pieces.size(); ++i) {
      const PieceDef& p = w.pieces[i];
      pb::Piece* pp = rl.mutable_layout()->mutable_pieces()->add_pieces();
      pp->set_tensor(kTensors[p.tensor].name);
      pp->mutable_box()->mutable_begin()->Assign(p.begin.begin(), p.begin.end());
      pp->mutable_box()->mutable_end()->Assign(p.end.begin(), p.end.end());
      pp->set_buffer_id(7);
      pp->set_offset_bytes(static_cast<uint64_t>(w.offsets[i]));
      int64_t rows = p.end[0] - p.begin[0], cols = p.end[1] - p.begin[1];
      if (p.transposed) { pp->add_strides(1); pp->add_strides(rows); } else { pp->add_strides(cols); pp->add_strides(1); }
    }
    grpc::ClientContext c2;
    pb::RegisterLayoutResponse rlr;
    return w.stub->RegisterLayout(&c2, rl, &rlr);
  }

  std::unique_ptr<Server> coord_;
  std::vector<std::unique_ptr<Server>> nodes_;
  std::vector<std::unique_ptr<TestWorker>> workers_;
};

TEST_P(MultiNodeTest, BytesArriveByteExact) {
  const pb::Mode mode = GetParam();
  pb::ModelSpec spec;
  spec.set_model_id("m");
  for (const Tensor& t : kTensors) {
    pb::TensorSpec* ts = spec.mutable_explicit_tensors()->add_tensors();
    ts->set_name(t.name);
    ts->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    ts->set_dtype(t.elem == 4 ? pb::DTYPE_F32 : pb::DTYPE_BF16);
  }
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(2);
  spec.set_mode(mode);
  // Trainers split `a` by rows across nodes; rollouts split it by columns (one transposed).
  TestWorker& t0 = AddWorker("t0", pb::ROLE_TRAINER, 0, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& t1 = AddWorker("t1", pb::ROLE_TRAINER, 1, {{0, {4, 0}, {8, 16}, false}});
  TestWorker& r0 = AddWorker("r0", pb::ROLE_ROLLOUT, 0, {{0, {0, 0}, {8, 8}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& r1 = AddWorker("r1", pb::ROLE_ROLLOUT, 1, {{0, {0, 8}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}});
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(Register(*w, spec).ok()) << w->id;

  // A malformed layout is rejected naming tensor and box, and changes nothing.
  {
    TestWorker& bad = AddWorker("bad", pb::ROLE_ROLLOUT, 0, {{0, {0, 0}, {9, 16}, false}});
    grpc::Status s = Register(bad, spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("tensor a box [0:9, 0:16]"), std::string::npos) << s.error_message();
  }

  for (uint64_t v : {1u, 2u}) {
    Fill(t0, v);
    Fill(t1, v);
    std::vector<std::thread> threads;
    std::vector<grpc::Status> st(2);
    if (mode == pb::MODE_SYNC) {
      for (TestWorker* r : {&r0, &r1}) {
        grpc::ClientContext ctx;
        pb::BeginUpdateRequest req;
        req.set_model_id("m");
        req.set_worker_id(r->id);
        pb::BeginUpdateResponse resp;
        ASSERT_TRUE(r->stub->BeginUpdate(&ctx, req, &resp).ok());
      }
    }
    int i = 0;
    for (TestWorker* t : {&t0, &t1}) {
      threads.emplace_back([t, v, &st, i] {
        grpc::ClientContext ctx;
        pb::PublishRequest req;
        req.set_model_id("m");
        req.set_worker_id(t->id);
        req.set_version(v);
        req.set_timeout_ms(20000);
        pb::PublishResponse resp;
        st[i] = t->stub->Publish(&ctx, req, &resp);
      });
      ++i;
    }
    for (auto& th : threads) th.join();
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s.error_message();
    // Trainers move on (their weights change) - staging must not care.
    if (mode != pb::MODE_SYNC) { Fill(t0, 99); Fill(t1, 99); }
    for (TestWorker* r : {&r0, &r1}) {
      grpc::ClientContext ctx;
      pb::ApplyRequest req;
      req.set_model_id("m");
      req.set_worker_id(r->id);
      req.set_version(v);
      req.set_timeout_ms(20000);
      pb::ApplyResponse resp;
      grpc::Status s = r->stub->Apply(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  grpc::ClientContext ctx;
  pb::StatusResponse status;
  ASSERT_TRUE(r0.stub->Status(&ctx, pb::StatusRequest(), &status).ok());
  ASSERT_EQ(status.models_size(), 1);
  EXPECT_EQ(status.models(0).committed_version(), 2u);
  EXPECT_GT(status.models(0).last_transfer_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, MultiNodeTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC));

}  // namespace
}  // namespace wb::daemon

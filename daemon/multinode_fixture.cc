#include "daemon/multinode_fixture.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/ctl_client.h"
#include "daemon/convert.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "tests/common/weight_gen.h"

namespace wb::daemon {
namespace {

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

}  // namespace

void Fill(TestWorker& w, uint64_t version) {
  ForEachElement(w, [&](int32_t t, int elem, int64_t flat, uint8_t* at) { WriteWeight(t, version, flat, elem, at); });
}

void FillDelta(TestWorker& w, uint64_t version, double fraction) {
  ForEachElement(w, [&](int32_t t, int elem, int64_t flat, uint8_t* at) { WriteDeltaWeight(t, version, flat, elem, fraction, at); });
}

int64_t CountBadDelta(const TestWorker& w, uint64_t version, double fraction) {
  int64_t bad = 0;
  ForEachElement(w, [&](int32_t t, int elem, int64_t flat, uint8_t* at) { bad += !CheckDeltaWeight(t, version, flat, elem, fraction, at); });
  return bad;
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

absl::StatusOr<transport::TransportSet> HostTransportsWrappingTcp(
    const std::function<std::unique_ptr<transport::Transport>(transport::TransportSet tcp)>& wrap) {
  transport::TransportConfig shm, tcp;
  shm.kinds = {"host_shm"};
  tcp.kinds = {"host_tcp"};
  auto set = transport::CreateTransports(shm);
  if (!set.ok()) return set.status();
  auto inner = transport::CreateTransports(tcp);
  if (!inner.ok()) return inner.status();
  set->Add(wrap(std::move(*inner)));
  return set;
}

void Cluster::StartCoordinator(absl::Duration lease, const std::string& listen,
                      const std::function<void(ServerOptions&)>& configure) {
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
void Cluster::StartNode(int n, BucketHook hook,
               std::function<bool()> skip_heartbeat, std::function<void(ServerOptions&)> configure) {
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
void Cluster::Stop() {
  workers_.clear();
  ShutDownDaemons();
}

void Cluster::ShutDownDaemons() {
  for (auto& n : nodes_) if (n) n->Shutdown();
  if (coord_) coord_->Shutdown();
}

TestWorker& Cluster::AddWorker(const std::string& id, pb::Role role, int node, const planner::Inventory* inv, planner::WorkerLayout layout) {
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
void Cluster::Connect(TestWorker& w) {
  auto ext = external_sockets_.find(w.node);
  const std::string socket = ext != external_sockets_.end() ? ext->second : nodes_[w.node]->worker_socket();
  w.stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", socket),
                                                          grpc::InsecureChannelCredentials()));
}

grpc::Status Cluster::Register(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset, int pid) {
  grpc::Status s = RegisterWorker(w, spec, pid);
  if (!s.ok()) return s;
  return RegisterLayout(w, spec, preset);
}

grpc::Status Cluster::RegisterWorker(TestWorker& w, const pb::ModelSpec& spec, int pid, int gpu) {
  grpc::ClientContext c1;
  pb::RegisterWorkerRequest rw;
  rw.set_model_id(spec.model_id());
  rw.set_worker_id(w.id);
  rw.set_role(w.role);
  rw.set_gpu(gpu);
  rw.set_pid(pid);
  rw.set_client_instance(w.client_instance);
  *rw.mutable_model() = spec;
  pb::RegisterWorkerResponse rwr;
  return w.stub->RegisterWorker(&c1, rw, &rwr);
}

grpc::Status Cluster::RegisterLayout(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset) {
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
      if (p.quant.has_value()) {  // a quantised rollout piece, its scales in the same buffer
        pp->set_quant_dtype(ToProto(p.quant->dtype));
        for (int64_t b : p.quant->block) pp->add_quant_block(b);
        pp->set_scale_buffer_id(7);
        pp->set_scale_offset_bytes(static_cast<uint64_t>(p.quant->scale_offset_bytes));
        pp->set_quant_scale_dtype(ToProto(p.quant->scale_dtype));  // int4's bf16 / f16 scales too (w4a16)
        if (p.quant->global_scale_offset_bytes >= 0) {  // NVFP4's second-level scale
          pp->set_quant_global_scale_offset(static_cast<uint64_t>(p.quant->global_scale_offset_bytes));
        }
      }
    }
  }
  grpc::ClientContext c2;
  pb::RegisterLayoutResponse rlr;
  return w.stub->RegisterLayout(&c2, rl, &rlr);
}

std::vector<grpc::Status> Cluster::Publish(const std::string& model, pb::Mode mode, uint64_t v, const std::vector<TestWorker*>& trainers,
                                  const std::vector<TestWorker*>& rollouts) {
  for (TestWorker* t : trainers) {
    if (delta_fraction > 0) {
      FillDelta(*t, v, delta_fraction);
    } else {
      Fill(*t, v);
    }
    if (after_fill) after_fill(*t, v);
  }
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

grpc::Status Cluster::Apply(TestWorker& r, const std::string& model, uint64_t v, pb::ApplyResponse* resp) {
  grpc::ClientContext ctx;
  pb::ApplyRequest req;
  req.set_model_id(model);
  req.set_worker_id(r.id);
  req.set_version(v);
  req.set_timeout_ms(20000);
  return r.stub->Apply(&ctx, req, resp);
}

absl::StatusOr<pb::StatusResponse> Cluster::WaitForCoordinator(const std::function<bool(const pb::StatusResponse&)>& pred,
                                                      absl::Duration timeout) {
  auto client = client::CtlClient::Connect(coord_->address(), timeout);
  if (!client.ok()) return client.status();
  return (*client)->WaitForStatus(pred, absl::Now() + timeout);
}

pb::VersionStatus Cluster::FinalVersion(uint64_t v, absl::Duration timeout) {
  auto is_final = [v](const pb::VersionStatus& vs) {
    return vs.version() == v && vs.state() != "queued" && vs.state() != "transferring";
  };
  auto st = WaitForCoordinator(
      [&](const pb::StatusResponse& s) { return std::any_of(s.versions().begin(), s.versions().end(), is_final); }, timeout);
  EXPECT_TRUE(st.ok()) << "version " << v << " not final in time: " << st.status();
  if (st.ok()) {
    for (const pb::VersionStatus& vs : st->versions()) {
      if (is_final(vs)) return vs;
    }
  }
  return {};
}

pb::StatusResponse Cluster::Status(TestWorker& w) {
  grpc::ClientContext ctx;
  pb::StatusResponse status;
  EXPECT_TRUE(w.stub->Status(&ctx, pb::StatusRequest(), &status).ok());
  return status;
}


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

pb::ModelSpec SpecOf(const planner::Inventory& inv, pb::Mode mode, pb::Strategy strategy, int trainers, int rollouts) {
  pb::ModelSpec spec;
  spec.set_model_id("m");
  for (const planner::TensorSpec& t : inv.tensors) {
    pb::TensorSpec* ts = spec.mutable_explicit_tensors()->add_tensors();
    ts->set_name(t.name);
    ts->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    ts->set_dtype(ToProto(t.dtype));
  }
  spec.set_num_trainer_workers(trainers);
  spec.set_num_rollout_workers(rollouts);
  spec.set_mode(mode);
  spec.set_strategy(strategy);
  return spec;
}

pb::ModelSpec SmallSpec(pb::Mode mode, pb::Strategy strategy) { return SpecOf(SmallInventory(), mode, strategy); }

TwoNodeWorkers AddTwoNodeWorkers(Cluster& c, const planner::Inventory& inv) {
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv, LayoutOf(inv, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  return {t0, t1, r0, r1};
}

TwoNodeWorkers StartTwoNodeCluster(Cluster& c, const planner::Inventory& inv, const TwoNodeSetup& setup) {
  c.StartCoordinator();
  c.StartNode(0, setup.n0_before_bucket, nullptr, [&](ServerOptions& o) {
    if (!setup.n0_live_copy_fault) return;
    o.configure_node = [fault = setup.n0_live_copy_fault](NodeDaemon::Options& no) { no.test_live_copy_fault = fault; };
  });
  c.StartNode(1, setup.n1_before_bucket);
  const pb::ModelSpec spec = SmallSpec(setup.mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c, inv);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) {
    grpc::Status s = c.Register(*x, spec);
    if (!s.ok()) ADD_FAILURE() << "registering " << x->id << ": " << s.error_message();
  }
  return w;
}

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

pb::WorkerStatus LocalStatus(Cluster& c, TestWorker& w) {
  const pb::StatusResponse status = c.Status(w);
  for (const pb::WorkerStatus& ws : status.workers()) {
    if (ws.worker_id() == w.id) return ws;
  }
  return pb::WorkerStatus();
}

grpc::Status BeginUpdateAs(TestWorker& r, int64_t timeout_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms) + std::chrono::seconds(10));
  pb::BeginUpdateRequest req;
  req.set_model_id("m");
  req.set_worker_id(r.id);
  req.set_timeout_ms(timeout_ms);
  pb::BeginUpdateResponse resp;
  return r.stub->BeginUpdate(&ctx, req, &resp);
}

grpc::Status EndUpdateAs(TestWorker& r, int64_t timeout_ms, pb::EndUpdateResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms) + std::chrono::seconds(10));
  pb::EndUpdateRequest req;
  req.set_model_id("m");
  req.set_worker_id(r.id);
  req.set_timeout_ms(timeout_ms);
  return r.stub->EndUpdate(&ctx, req, resp);
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

grpc::Status WaitVersionAs(TestWorker& w, const std::string& model, uint64_t v, int64_t timeout_ms, pb::WaitVersionResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms + 10000));
  pb::WaitVersionRequest req;
  req.set_model_id(model);
  req.set_version(v);
  req.set_timeout_ms(timeout_ms);
  req.set_worker_id(w.id);
  return w.stub->WaitVersion(&ctx, req, resp);
}

uint64_t CommittedOf(const pb::StatusResponse& st, const std::string& model) {
  for (const pb::ModelStatus& m : st.models()) {
    if (m.model_id() == model) return m.committed_version();
  }
  return 0;
}

}  // namespace wb::daemon

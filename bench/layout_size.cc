// What a layout of N explicit pieces costs the daemons (docs/security.md, the thirty-eighth
// session's size probe: 1e6 pieces took 20-48 s and +2.9 GB on the node, and held the
// coordinator's lock for 5 s). A coordinator and one node daemon in this process on 127.0.0.1:0
// (daemon/multinode_fixture.h), a trainer "t0" with N one-row pieces of one tensor in a shared
// memory buffer, then, each timed with the heap in use (mallinfo2) and RSS before and after and
// the peak RSS (VmHWM, reset before each step):
//   register  - RegisterLayout on the node's worker socket (node + coordinator);
//   describe  - DescribeLayout of the same pieces on the node (nothing kept);
//   submit    - JoinWorker + SubmitLayout of another trainer "t1" straight to the coordinator.
// Meanwhile a client polls ClusterStatus of another model every 20 ms: `status_max_ms` is its
// slowest answer during the step (what the coordinator's lock held it for).
// `kept_per_piece` = heap still in use after the step once the client dropped its request and
// answer, divided by N. `--tensor_name` names the tensor (default "w"; a real name, e.g.
// model.layers.17.mlp.experts.123.gate_up_proj.weight, shows what each piece's copy of it costs).
// `request_MB` / `answer_MB`: the client's parsed request and answer of the step (SpaceUsedLong), the
// client's part of the step's peak in this one process; `--request_before_peak` builds each
// request before the step (its peak then leaves the client's request out; kept is unchanged).
// Usage: bazel run -c opt //bench:layout_size -- [--pieces=N] [--tensor_name=NAME] [--request_before_peak] [--json]
#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/auth.h"
#include "daemon/convert.h"
#include "daemon/multinode_fixture.h"

ABSL_FLAG(int64_t, pieces, 1000000, "explicit pieces in the layout");
ABSL_FLAG(std::string, tensor_name, "w", "the name of the layout's one tensor (every piece names it)");
ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(bool, request_before_peak, false,
          "build each step's request before the step's peak is reset (the peak then leaves the client's request out)");

namespace wb::daemon {
namespace {

struct Mem {
  int64_t heap = 0;  // bytes in use by malloc
  int64_t rss = 0;
  int64_t hwm = 0;
};

int64_t ProcKb(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  }
  return 0;
}

Mem Now() {
  struct mallinfo2 mi = mallinfo2();
  return {static_cast<int64_t>(mi.uordblks + mi.hblkhd), ProcKb("VmRSS:"), ProcKb("VmHWM:")};
}

void ResetPeak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

struct Step {
  std::string name;
  bool ok = false;
  std::string error;
  double seconds = 0;
  double kept_mb = 0, kept_per_piece = 0, peak_mb = 0;
  double status_max_ms = 0;
  double request_mb = 0, answer_mb = 0;  // the client's parsed request and answer
};

// Polls ClusterStatus of model "other" while `fn` runs.
template <typename Fn>
Step Measure(const std::string& name, pb::CoordinatorService::Stub& coord, int64_t n, Fn fn) {
  Step s;
  s.name = name;
  malloc_trim(0);
  const Mem before = Now();
  ResetPeak();
  std::atomic<bool> done{false};
  double worst = 0;
  std::thread poller([&] {
    while (!done.load()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
      pb::StatusRequest req;
      req.set_model_id("other");
      pb::StatusResponse resp;
      const absl::Time t0 = absl::Now();
      (void)coord.ClusterStatus(&ctx, req, &resp);
      worst = std::max(worst, absl::ToDoubleMilliseconds(absl::Now() - t0));
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  const absl::Time t0 = absl::Now();
  grpc::Status st = fn(s);  // drops its answer (and its request, unless built before) before it returns
  s.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  done = true;
  poller.join();
  s.ok = st.ok();
  s.error = st.error_message().substr(0, 200);
  const Mem peak = Now();
  malloc_trim(0);
  const Mem after = Now();
  s.kept_mb = (after.heap - before.heap) / 1e6;
  s.kept_per_piece = static_cast<double>(after.heap - before.heap) / static_cast<double>(n);
  s.peak_mb = (peak.hwm - before.rss) / 1e6;
  s.status_max_ms = worst;
  return s;
}

pb::LayoutSpec Pieces(int64_t n, uint32_t buffer_id, const std::string& name) {
  pb::LayoutSpec layout;
  auto* pieces = layout.mutable_pieces()->mutable_pieces();
  pieces->Reserve(static_cast<int>(n));
  for (int64_t i = 0; i < n; ++i) {
    pb::Piece* p = pieces->Add();
    p->set_tensor(name);
    p->mutable_box()->add_begin(i);
    p->mutable_box()->add_begin(0);
    p->mutable_box()->add_end(i + 1);
    p->mutable_box()->add_end(8);
    p->set_buffer_id(buffer_id);
    p->set_offset_bytes(static_cast<uint64_t>(i) * 16);
    p->add_strides(8);
    p->add_strides(1);
  }
  return layout;
}

int Main(int64_t n, const std::string& name, bool json, bool request_before_peak) {
  planner::Inventory inv;
  inv.tensors.push_back({name, {n, 8}, planner::DType::kBF16});
  planner::Inventory other_inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Seconds(30), "127.0.0.1:0", [](ServerOptions& o) { o.bucket_bytes = int64_t{1} << 30; });
  c.StartNode(0);
  pb::ModelSpec spec = SpecOf(inv, pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE, /*trainers=*/3, /*rollouts=*/1);
  pb::ModelSpec other = SpecOf(other_inv, pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  other.set_model_id("other");
  auto coord = pb::CoordinatorService::NewStub(MakePeerChannel(c.coord_->address(), PeerAuthConfig(), int64_t{1} << 30));
  {
    grpc::ClientContext ctx;
    pb::CreateModelRequest req;
    *req.mutable_model() = other;
    pb::CreateModelResponse resp;
    grpc::Status st = coord->CreateModel(&ctx, req, &resp);
    if (!st.ok()) {
      std::fprintf(stderr, "CreateModel other: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  planner::WorkerLayout layout;
  layout.buffers.push_back({n * 16});
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, layout);
  // The answer describes every piece: far over gRPC's default 4 MB receive limit.
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  t0.stub = pb::WorkerService::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("unix:", c.nodes_[0]->worker_socket()), grpc::InsecureChannelCredentials(), args));
  if (grpc::Status st = c.RegisterWorker(t0, spec); !st.ok()) {
    std::fprintf(stderr, "RegisterWorker: %s\n", st.error_message().c_str());
    return 1;
  }
  std::vector<Step> steps;
  // Each step's request: built inside the step, or before it (--request_before_peak: kept alive
  // until the step was measured, so the kept heap is the same either way).
  auto register_request = [&] {
    pb::RegisterLayoutRequest req;
    req.set_model_id("m");
    req.set_worker_id("t0");
    pb::BufferSpec* b = req.add_buffers();
    b->set_buffer_id(7);
    b->set_size_bytes(static_cast<uint64_t>(t0.seg.size()));
    b->set_shm_name(t0.seg.name());
    b->set_gpu(-1);
    *req.mutable_layout() = Pieces(n, 7, name);
    return req;
  };
  auto describe_request = [&] {
    pb::DescribeLayoutRequest req;
    req.set_model_id("m");
    req.set_worker_id("t0");
    *req.mutable_layout() = Pieces(n, 7, name);
    return req;
  };
  auto submit_request = [&] {
    pb::SubmitLayoutRequest req;
    req.set_node_id("n0");
    req.set_model_id("m");
    req.set_worker_id("t1");
    pb::BufferSpec* b = req.add_buffers();
    b->set_buffer_id(3);
    b->set_size_bytes(static_cast<uint64_t>(n) * 16);
    b->set_shm_name("/not-mapped-by-the-coordinator");
    *req.mutable_layout() = Pieces(n, 3, name);
    return req;
  };
  // Calls `call` with the step's request and records the client's parsed request and answer.
  auto step = [&](const std::string& step_name, auto make_request, auto call) {
    using Req = decltype(make_request());
    std::optional<Req> early;
    if (request_before_peak) early.emplace(make_request());
    steps.push_back(Measure(step_name, *coord, n, [&](Step& s) {
      std::optional<Req> own;
      const Req& req = early ? *early : own.emplace(make_request());
      s.request_mb = static_cast<double>(req.SpaceUsedLong()) / 1e6;
      return call(req, &s.answer_mb);
    }));
  };
  step("register", register_request, [&](const pb::RegisterLayoutRequest& req, double* answer_mb) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    pb::RegisterLayoutResponse resp;
    grpc::Status st = t0.stub->RegisterLayout(&ctx, req, &resp);
    *answer_mb = static_cast<double>(resp.SpaceUsedLong()) / 1e6;
    return st;
  });
  step("describe", describe_request, [&](const pb::DescribeLayoutRequest& req, double* answer_mb) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    pb::DescribeLayoutResponse resp;
    grpc::Status st = t0.stub->DescribeLayout(&ctx, req, &resp);
    *answer_mb = static_cast<double>(resp.SpaceUsedLong()) / 1e6;
    return st;
  });
  step("submit", submit_request, [&](const pb::SubmitLayoutRequest& req, double* answer_mb) {
    {
      pb::JoinWorkerRequest join;
      join.set_node_id("n0");
      join.set_model_id("m");
      join.set_worker_id("t1");
      join.set_role(pb::ROLE_TRAINER);
      grpc::ClientContext ctx;
      pb::JoinWorkerResponse resp;
      if (grpc::Status st = coord->JoinWorker(&ctx, join, &resp); !st.ok()) return st;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    pb::SubmitLayoutResponse resp;
    grpc::Status st = coord->SubmitLayout(&ctx, req, &resp);
    *answer_mb = static_cast<double>(resp.SpaceUsedLong()) / 1e6;
    return st;
  });
  if (json) {
    std::string out = absl::StrCat("{\"pieces\": ", n, ", \"tensor_name_bytes\": ", name.size(), ", \"steps\": [");
    for (size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      absl::StrAppend(&out, i ? ", " : "", "{\"step\": \"", s.name, "\", \"ok\": ", s.ok ? "true" : "false", ", \"seconds\": ", s.seconds,
                      ", \"kept_mb\": ", s.kept_mb, ", \"kept_bytes_per_piece\": ", s.kept_per_piece, ", \"peak_rss_mb\": ", s.peak_mb,
                      ", \"status_max_ms\": ", s.status_max_ms, ", \"request_mb\": ", s.request_mb, ", \"answer_mb\": ", s.answer_mb, "}");
    }
    std::printf("%s]}\n", out.c_str());
  } else {
    std::printf("%-9s %4s %9s %10s %15s %12s %14s %11s %10s\n", "step", "ok", "seconds", "kept_MB", "kept_B/piece", "peak_RSS_MB",
                "status_max_ms", "request_MB", "answer_MB");
    for (const Step& s : steps) {
      std::printf("%-9s %4s %9.2f %10.1f %15.0f %12.1f %14.1f %11.1f %10.1f %s\n", s.name.c_str(), s.ok ? "ok" : "FAIL", s.seconds, s.kept_mb,
                  s.kept_per_piece, s.peak_mb, s.status_max_ms, s.request_mb, s.answer_mb, s.ok ? "" : s.error.c_str());
    }
  }
  c.Stop();
  for (const Step& s : steps) {
    if (!s.ok) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace wb::daemon

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return wb::daemon::Main(absl::GetFlag(FLAGS_pieces), absl::GetFlag(FLAGS_tensor_name), absl::GetFlag(FLAGS_json),
                             absl::GetFlag(FLAGS_request_before_peak));
}

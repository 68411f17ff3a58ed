// Control-plane scale bench (issue 14.6): the real coordinator (CoordinatorCore, in process)
// against N in-process fake node daemons (FakeNodeClient: every RPC answered at once, ReportDone
// sent as soon as a node is told to execute), 8 GPUs (workers) per node, half the nodes trainers,
// half rollouts, on a Kimi-K2-sized model (the real Kimi-K2 inventory from its HF config; every
// tensor whole on one trainer and on one rollout, so a version moves the whole model once; each
// trainer node sends to 4 rollout nodes).
//
// Per N it prints: the coordinator's own time per version from the first trainer's Publish to
// all-committed (WaitVersion answered), heartbeat latency p99 while the plan is made, the plan
// time (last layout submitted -> plan installed on every node), and the process RSS.
//
//   bazel run -c opt //bench:control_plane -- [--json] [--nodes=8,64,256,1024] [--versions=5]
//
// With --json: {"results": [{"nodes", "version_overhead_ms", "heartbeat_p99_ms", "plan_ms",
// "rss_bytes", ...}, ...]}.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/parallel_for.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/log.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(std::string, nodes, "8,64,256,1024", "node counts to run, comma-separated");
ABSL_FLAG(int, versions, 5, "versions per node count");
ABSL_FLAG(int, gpus_per_node, 8, "workers (GPUs) per node");
ABSL_FLAG(std::string, model, "planner/testdata/kimi-k2.json", "HF config.json of the model (runfiles path)");
ABSL_FLAG(bool, in_process, false, "run every node count in this process (default: one child process per count, so RSS is per count)");

namespace wb::bench {
namespace {

namespace pb = ::weightbridge::v1;
using daemon::CoordinatorCore;
using daemon::CoordinatorOptions;
using daemon::FakeNodeClient;
using daemon::NodeClient;

struct Result {
  int nodes = 0;
  std::vector<double> version_ms;
  double heartbeat_p99_ms = 0, heartbeat_samples = 0;
  double plan_ms = 0, planner_ms = 0, setup_s = 0;
  int64_t rss_bytes = 0;
  int64_t ops = 0;
};

int64_t RssBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

double P99(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(v.size() * 0.99))];
}

// fn(i) for i in [0, n) on `threads` threads.
void Parallel(int n, int threads, const std::function<void(int)>& fn) {
  ParallelFor(static_cast<size_t>(n), static_cast<size_t>(threads), [&](size_t i) { fn(static_cast<int>(i)); });
}

int ElementBytes(pb::DType d) { return d == pb::DTYPE_F32 ? 4 : d == pb::DTYPE_F8_E4M3 ? 1 : 2; }

// Whole tensors, packed in one buffer per worker: tensor t on trainer t % T; its rollout sits on
// one of 4 rollout nodes paired with that trainer's node (same GPU index), so each node talks to a
// bounded set of peers as with real TP/EP layouts (a node's slice carries the layouts of its op
// peers: all-to-all placement would put every layout into every slice). Trainers fill the first
// `half` nodes, rollouts the rest, `gpus` workers per node.
std::vector<pb::SubmitLayoutRequest> Layouts(const pb::CreateModelResponse& cresp, const std::vector<std::string>& nodes, int half,
                                             int gpus, std::vector<std::string>* worker_ids) {
  const int n_nodes = static_cast<int>(nodes.size());
  const int trainers = half * gpus, rollouts = (n_nodes - half) * gpus;
  const int rollout_nodes = n_nodes - half;
  std::vector<pb::SubmitLayoutRequest> layouts(static_cast<size_t>(trainers + rollouts));
  std::vector<uint64_t> offsets(layouts.size(), 0);
  for (int t = 0; t < cresp.tensors_size(); ++t) {
    const pb::TensorSpec& ts = cresp.tensors(t);
    const int tr = t % trainers, tnode = tr / gpus;
    const int rnode = (tnode * 4 + (t / trainers) % 4) % rollout_nodes;
    const int owners[2] = {tr, trainers + rnode * gpus + tr % gpus};
    for (int w : owners) {
      pb::Piece* p = layouts[w].mutable_layout()->mutable_pieces()->add_pieces();
      p->set_tensor(ts.name());
      int64_t elements = 1;
      for (int64_t d : ts.shape()) {
        p->mutable_box()->add_begin(0);
        p->mutable_box()->add_end(d);
        elements *= d;
      }
      int64_t stride = 1;
      std::vector<int64_t> strides(static_cast<size_t>(ts.shape_size()));
      for (int d = ts.shape_size() - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= ts.shape(d);
      }
      for (int64_t s : strides) p->add_strides(s);
      p->set_buffer_id(0);
      p->set_offset_bytes(offsets[w]);
      offsets[w] += (static_cast<uint64_t>(elements) * ElementBytes(ts.dtype()) + 255) / 256 * 256;
    }
  }
  worker_ids->assign(layouts.size(), "");
  for (size_t w = 0; w < layouts.size(); ++w) {
    const bool trainer = static_cast<int>(w) < trainers;
    const int node = trainer ? static_cast<int>(w) / gpus : half + (static_cast<int>(w) - trainers) / gpus;
    (*worker_ids)[w] = absl::StrFormat("%s-%05d", trainer ? "t" : "r", trainer ? w : w - trainers);
    pb::SubmitLayoutRequest& l = layouts[w];
    l.set_node_id(nodes[node]);
    l.set_model_id("m");
    l.set_worker_id((*worker_ids)[w]);
    pb::BufferSpec* b = l.add_buffers();
    b->set_buffer_id(0);
    b->set_size_bytes(std::max<uint64_t>(offsets[w], 256));
    b->set_shm_name("/wb-bench-" + (*worker_ids)[w]);
    b->set_gpu(-1);
  }
  return layouts;
}

absl::StatusOr<Result> RunOne(int n_nodes, int gpus, int versions, const std::string& config_json) {
  Result r;
  r.nodes = n_nodes;
  const absl::Time setup_start = absl::Now();
  CoordinatorCore* core_ptr = nullptr;
  CoordinatorOptions o;
  o.lease = absl::Hours(1);  // setup of a large cluster takes longer than a lease; heartbeats are measured, not needed
  o.transfer_timeout = absl::Minutes(10);
  o.max_reply_bytes = int64_t{64} << 20;  // the Kimi-K2 inventory reply is over the 4 MiB default
  o.make_node_client = [&core_ptr](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
    auto fake = std::make_shared<FakeNodeClient>(node);
    fake->on_execute = [&core_ptr, node](const pb::ExecuteVersionRequest& req) {
      pb::ReportDoneRequest done;
      done.set_node_id(node);
      done.set_model_id(req.model_id());
      done.set_version(req.version());
      done.set_ok(true);
      done.set_coordinator_instance(req.coordinator_instance());
      pb::ReportDoneResponse resp;
      return core_ptr->ReportDone(done, &resp);
    };
    return fake;
  };
  CoordinatorCore core(o);
  core_ptr = &core;
  core.Start();
  std::vector<std::string> nodes;
  std::vector<uint64_t> incarnations;
  for (int i = 0; i < n_nodes; ++i) {
    nodes.push_back(absl::StrFormat("node-%04d", i));
    pb::RegisterNodeRequest req;
    req.set_node_id(nodes.back());
    req.set_address(absl::StrCat(nodes.back(), ":7000"));
    req.set_data_address(absl::StrCat(nodes.back(), ":7001"));
    pb::RegisterNodeResponse resp;
    if (absl::Status s = core.RegisterNode(req, &resp); !s.ok()) return s;
    incarnations.push_back(resp.incarnation());
  }
  const int half = std::max(1, n_nodes / 2);
  const int trainers = half * gpus, rollouts = (n_nodes - half) * gpus;
  pb::CreateModelRequest creq;
  pb::ModelSpec& spec = *creq.mutable_model();
  spec.set_model_id("m");
  spec.set_hf_config_json(config_json);
  spec.set_num_trainer_workers(static_cast<uint32_t>(trainers));
  spec.set_num_rollout_workers(static_cast<uint32_t>(rollouts));
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  pb::CreateModelResponse cresp;
  if (absl::Status s = core.CreateModel(creq, &cresp); !s.ok()) return s;
  std::vector<std::string> worker_ids;
  std::vector<pb::SubmitLayoutRequest> layouts = Layouts(cresp, nodes, half, gpus, &worker_ids);
  // Joins and every layout but the last: setup, not measured.
  std::atomic<bool> failed{false};
  std::string error;
  Parallel(static_cast<int>(layouts.size()), 4, [&](int w) {
    pb::JoinWorkerRequest j;
    j.set_node_id(layouts[w].node_id());
    j.set_worker_id(worker_ids[w]);
    j.set_model_id("m");
    j.set_role(w < trainers ? pb::ROLE_TRAINER : pb::ROLE_ROLLOUT);
    j.set_gpu(w % gpus);
    pb::JoinWorkerResponse jr;
    absl::Status s = core.JoinWorker(j, &jr);
    if (s.ok() && w + 1 < static_cast<int>(layouts.size())) {
      pb::SubmitLayoutResponse lr;
      s = core.SubmitLayout(layouts[w], &lr);
    }
    if (!s.ok() && !failed.exchange(true)) error = s.ToString();
  });
  if (failed) return absl::InternalError(error);
  r.setup_s = absl::ToDoubleSeconds(absl::Now() - setup_start);

  // The last layout triggers the plan; heartbeats from 4 threads meanwhile, until installed.
  std::atomic<bool> planning{true};
  std::vector<std::vector<double>> hb_ms(4);
  std::vector<std::thread> beaters;
  for (int t = 0; t < 4; ++t) {
    beaters.emplace_back([&, t] {
      for (int i = t; planning; i += 4) {
        pb::HeartbeatRequest hb;
        const int node = i % n_nodes;
        hb.set_node_id(nodes[node]);
        hb.set_incarnation(incarnations[node]);
        pb::HeartbeatResponse resp;
        const absl::Time t0 = absl::Now();
        core.Heartbeat(hb, &resp).IgnoreError();
        hb_ms[t].push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
        // About 4,000 heartbeats a second in all: 1,024 nodes beating every 250 ms (the lease is
        // 3 s), without four threads spinning on the coordinator's lock.
        absl::SleepFor(absl::Milliseconds(1));
      }
    });
  }
  const absl::Time plan_start = absl::Now();
  pb::SubmitLayoutResponse lr;
  if (absl::Status s = core.SubmitLayout(layouts.back(), &lr); !s.ok()) return s;
  const bool installed = core.AwaitPlanInstalled("m", absl::Now() + absl::Minutes(30));
  r.plan_ms = absl::ToDoubleMilliseconds(absl::Now() - plan_start);
  planning = false;
  for (auto& t : beaters) t.join();
  if (!installed) return absl::DeadlineExceededError("plan not installed within 30 minutes");
  std::vector<double> all_hb;
  for (auto& v : hb_ms) all_hb.insert(all_hb.end(), v.begin(), v.end());
  r.heartbeat_p99_ms = P99(all_hb);
  r.heartbeat_samples = static_cast<double>(all_hb.size());
  pb::PlanResponse plan;
  if (absl::Status s = core.Plan([] { pb::PlanRequest p; p.set_model_id("m"); return p; }(), &plan); !s.ok()) return s;
  r.planner_ms = plan.stats().plan_ms();
  r.ops = plan.stats().num_ops();

  // Versions: every trainer publishes (its node's Publish RPC), then wait for all-committed.
  for (int v = 1; v <= versions; ++v) {
    const absl::Time t0 = absl::Now();
    Parallel(trainers, 4, [&](int w) {
      pb::CoordPublishRequest p;
      p.set_model_id("m");
      p.set_worker_id(worker_ids[w]);
      p.set_node_id(layouts[w].node_id());
      p.set_version(static_cast<uint64_t>(v));
      p.set_timeout_ms(600000);
      pb::PublishResponse resp;
      absl::Status s = core.Publish(p, &resp);
      if (!s.ok() && !failed.exchange(true)) error = s.ToString();
    });
    pb::WaitVersionRequest wreq;
    wreq.set_model_id("m");
    wreq.set_version(static_cast<uint64_t>(v));
    wreq.set_timeout_ms(600000);
    pb::WaitVersionResponse wresp;
    if (absl::Status s = core.WaitVersion(wreq, &wresp); !s.ok()) return s;
    if (failed) return absl::InternalError(error);
    r.version_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
  }
  r.rss_bytes = RssBytes();
  core.Shutdown();
  return r;
}

}  // namespace
}  // namespace wb::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace wb::bench;
  wb::daemon::SetLogLevel(wb::daemon::LogLevel::kWarning);
  std::ifstream f(absl::GetFlag(FLAGS_model));
  if (!f) {
    std::cerr << "control_plane: cannot read --model " << absl::GetFlag(FLAGS_model) << "\n";
    return 2;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json out = {{"results", nlohmann::json::array()}};
  std::vector<std::string> counts = absl::StrSplit(absl::GetFlag(FLAGS_nodes), ',');
  if (counts.size() > 1 && !absl::GetFlag(FLAGS_in_process)) {
    // One child per node count: each RSS is that cluster's alone (freed memory of a previous run
    // would stay in this process's heap).
    for (const std::string& n : counts) {
      const std::string cmd = absl::StrCat("/proc/", getpid(), "/exe --in_process --json --nodes=", n, " --versions=",
                                           absl::GetFlag(FLAGS_versions), " --gpus_per_node=", absl::GetFlag(FLAGS_gpus_per_node),
                                           " --model='", absl::GetFlag(FLAGS_model), "'");
      FILE* p = popen(cmd.c_str(), "r");
      if (p == nullptr) return 1;
      std::string text;
      char buf[4096];
      while (size_t got = fread(buf, 1, sizeof(buf), p)) text.append(buf, got);
      if (pclose(p) != 0) {
        std::cerr << "control_plane: " << n << " nodes failed\n";
        return 1;
      }
      auto child = nlohmann::json::parse(text.substr(text.rfind("{\"results\"")), nullptr, false);
      if (child.is_discarded() || child["results"].empty()) {
        std::cerr << "control_plane: " << n << " nodes: unreadable child output: " << text << "\n";
        return 1;
      }
      const nlohmann::json& r = child["results"][0];
      out["results"].push_back(r);
      if (!absl::GetFlag(FLAGS_json)) {
        std::cout << absl::StrFormat("%5d nodes (%5d workers): version %8.2f ms  heartbeat p99 %6.3f ms (%d during the plan)  plan %9.1f ms "
                                     "(planner %9.1f ms, %d ops)  rss %6.0f MiB  setup %.1f s\n",
                                     r["nodes"].get<int>(), r["workers"].get<int>(), r["version_overhead_ms"].get<double>(),
                                     r["heartbeat_p99_ms"].get<double>(), static_cast<int>(r["heartbeat_samples"].get<double>()),
                                     r["plan_ms"].get<double>(), r["planner_ms"].get<double>(), static_cast<int>(r["plan_ops"].get<int64_t>()),
                                     r["rss_bytes"].get<int64_t>() / 1048576.0, r["setup_s"].get<double>());
        std::cout.flush();
      }
    }
    if (absl::GetFlag(FLAGS_json)) std::cout << out.dump() << "\n";
    return 0;
  }
  for (absl::string_view n : counts) {
    int nodes = 0;
    if (!absl::SimpleAtoi(n, &nodes) || nodes < 2) {
      std::cerr << "control_plane: --nodes wants counts >= 2, got '" << n << "'\n";
      return 2;
    }
    auto r = RunOne(nodes, absl::GetFlag(FLAGS_gpus_per_node), absl::GetFlag(FLAGS_versions), ss.str());
    if (!r.ok()) {
      std::cerr << "control_plane: " << nodes << " nodes: " << r.status() << "\n";
      return 1;
    }
    std::vector<double> sorted = r->version_ms;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted.empty() ? 0 : sorted[sorted.size() / 2];
    out["results"].push_back({{"nodes", r->nodes},
                              {"workers", r->nodes * absl::GetFlag(FLAGS_gpus_per_node)},
                              {"version_overhead_ms", median},
                              {"version_ms", r->version_ms},
                              {"heartbeat_p99_ms", r->heartbeat_p99_ms},
                              {"heartbeat_samples", r->heartbeat_samples},
                              {"plan_ms", r->plan_ms},
                              {"planner_ms", r->planner_ms},
                              {"plan_ops", r->ops},
                              {"setup_s", r->setup_s},
                              {"rss_bytes", r->rss_bytes}});
    if (!absl::GetFlag(FLAGS_json)) {
      std::cout << absl::StrFormat(
          "%5d nodes (%5d workers): version %8.2f ms (median of %d: %s)  heartbeat p99 %6.3f ms (%d during the plan)  plan %9.1f ms "
          "(planner %9.1f ms, %d ops)  rss %6.0f MiB  setup %.1f s\n",
          r->nodes, r->nodes * absl::GetFlag(FLAGS_gpus_per_node), median, static_cast<int>(r->version_ms.size()),
          [&] {
            std::string s;
            for (double v : r->version_ms) absl::StrAppend(&s, s.empty() ? "" : " ", absl::StrFormat("%.1f", v));
            return s;
          }(),
          r->heartbeat_p99_ms, static_cast<int>(r->heartbeat_samples), r->plan_ms, r->planner_ms, static_cast<int>(r->ops),
          r->rss_bytes / 1048576.0, r->setup_s);
      std::cout.flush();
    }
  }
  if (absl::GetFlag(FLAGS_json)) std::cout << out.dump() << "\n";
  return 0;
}

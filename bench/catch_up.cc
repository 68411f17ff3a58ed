// bench/catch_up: how long a late rollout waits for the committed version (issue 16.6, docs/daemon.md
// "Catch-up") against one normal update, in every mode, on the 1 GB demo model.
//
//   bazel run -c opt //bench:catch_up [-- --json] [-- --modes=sync,async --config=... --quantization=fp8_block128]
//
// Setup (one process, real daemons and transports on loopback, as daemon:catch_up_test): a
// coordinator and two node daemons; Megatron tp=2 trainer ranks on n0, two vLLM replicas on n1
// (shm workers). Per mode: version 1 (warm-up: plans, connections) and version 2 are published and
// received by both replicas; "update_s" is version 2's time from the trainers' Publish to the last
// replica holding it (sync: Publish returns once live weights hold it; otherwise Publish, then Apply).
// Then a late replica registers on n1 (sources on its own node: same_node_catch_up_s) and another
// on n0 (sources on the peer node over host_tcp: peer_catch_up_s): each time is from its
// RegisterLayout returning to its WaitVersion (sync) / Apply (otherwise) reporting version 2, and
// every byte of the late replica is then checked against version 2. ratio = catch-up / update.
// Each window is broken down (setup, transfer, digest, commit with its live copy, apply) from the
// daemons' log lines (LogTap below): --json adds update_parts / same_node_parts / peer_parts.
// The late replicas' memory is touched before they register (an engine's weights are allocated).
// The node of the peer case (n0) held no rollout before: its first catch-up allocates staging
// memory that a node receiving every version already holds (the staging pool), and pays for it.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/multinode_fixture.h"
#include "planner/model_config.h"
#include "planner/presets.h"

ABSL_FLAG(bool, json, false, "print one JSON line per mode");
ABSL_FLAG(std::string, modes, "sync,one_step_off,async", "modes to run");
ABSL_FLAG(std::string, config, "tests/e2e/testdata/qwen2.5-0.5b.json", "HF config.json of the model");
ABSL_FLAG(std::string, quantization, "",
          "the vLLM replicas' quantization preset (fp8_block128, mxfp8, w4a16_g32): late replicas are then served the "
          "other replicas' quantised bytes, and checked byte for byte against replica r0 (same layout)");

namespace wb::daemon {
namespace {

// Where a window's time went, from the daemons' own log lines (they run in this process and log
// to stderr: the bench reads its stderr through a pipe, echoes every line and keeps these):
//   setup    = from the window's start to the transfer starting on its slowest node (coordinator:
//              choosing, planning, ExecuteVersion) + that node's staging_s + setup_s (channels)
//   transfer = buckets_s - digest_s of the slowest node (the bytes moving)
//   digest   = digest_s of that node (end-to-end digests after the buckets)
//   commit   = transfer done -> the coordinator's "version committed" / "catch-up committed" line
//              (a sync commit copies staging into live weights here: copy_s = the slowest node's)
//   apply    = that line -> the client call returning (one-step-off / async: Apply's live copy)
struct LogLine {
  absl::Time at;
  std::string msg;
  std::map<std::string, std::string> fields;
  double Num(const std::string& k) const {
    auto it = fields.find(k);
    double v = 0;
    return it != fields.end() && absl::SimpleAtod(it->second, &v) ? v : 0;
  }
};

class LogTap {
 public:
  // Routes fd 2 through a pipe read by a thread (lines echoed to the original stderr).
  void Start() {
    int p[2];
    if (pipe(p) != 0) return;
    saved_ = dup(2);
    dup2(p[1], 2);
    close(p[1]);
    read_fd_ = p[0];
    reader_ = std::thread([this] { Read(); });
  }
  std::vector<LogLine> Since(absl::Time t) {
    absl::MutexLock l(&mu_);
    std::vector<LogLine> out;
    for (const LogLine& x : lines_) {
      if (x.at >= t) out.push_back(x);
    }
    return out;
  }
  // Blocks until a line with `msg` arrived at or after `t` (log lines come a moment after the
  // call that caused them returns), or 5 s passed.
  void AwaitLine(const std::string& msg, absl::Time t) {
    absl::MutexLock l(&mu_);
    auto seen = [&] {
      for (const LogLine& x : lines_) {
        if (x.at >= t && x.msg == msg) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&seen), absl::Seconds(5));
  }

 private:
  void Read() {
    std::string buf;
    char chunk[65536];
    while (true) {
      const ssize_t n = read(read_fd_, chunk, sizeof(chunk));
      if (n <= 0) return;
      (void)!write(saved_, chunk, static_cast<size_t>(n));
      buf.append(chunk, static_cast<size_t>(n));
      size_t nl;
      while ((nl = buf.find('\n')) != std::string::npos) {
        Parse(buf.substr(0, nl));
        buf.erase(0, nl + 1);
      }
    }
  }
  void Parse(const std::string& line) {
    LogLine x;
    x.at = absl::Now();
    size_t i = line.find(' ');
    while (i != std::string::npos && i < line.size()) {
      const size_t eq = line.find('=', i + 1);
      if (eq == std::string::npos) break;
      const std::string key = line.substr(i + 1, eq - i - 1);
      std::string value;
      size_t next;
      if (eq + 1 < line.size() && line[eq + 1] == '"') {
        const size_t q = line.find('"', eq + 2);
        value = line.substr(eq + 2, q == std::string::npos ? std::string::npos : q - eq - 2);
        next = q == std::string::npos ? std::string::npos : line.find(' ', q);
      } else {
        next = line.find(' ', eq);
        value = line.substr(eq + 1, next == std::string::npos ? std::string::npos : next - eq - 1);
      }
      (key == "msg" ? x.msg : x.fields[key]) = value;
      i = next;
    }
    if (x.msg.empty()) return;
    absl::MutexLock l(&mu_);
    lines_.push_back(std::move(x));
  }

  int saved_ = -1, read_fd_ = -1;
  std::thread reader_;  // detached at exit: the process ends with it blocked in read
  absl::Mutex mu_;
  std::vector<LogLine> lines_ ABSL_GUARDED_BY(mu_);

 public:
  ~LogTap() {
    if (reader_.joinable()) reader_.detach();
  }
};

LogTap& Tap() {
  static LogTap* tap = new LogTap;
  return *tap;
}

struct Breakdown {
  double setup_s = 0, transfer_s = 0, digest_s = 0, commit_s = 0, copy_s = 0, apply_s = 0;
};

// The breakdown of a window [start, end] in which `committed_msg` ends the version (or catch-up)
// of `version` on the coordinator.
Breakdown BreakdownOf(absl::Time start, absl::Time end, uint64_t version, const std::string& committed_msg) {
  Tap().AwaitLine(committed_msg, start);
  Breakdown b;
  const LogLine* slowest = nullptr;
  std::vector<LogLine> lines = Tap().Since(start);
  absl::Time committed = end;
  for (const LogLine& x : lines) {
    if (x.Num("version") != version) continue;
    if (x.msg == "version transferred" && (slowest == nullptr || x.at > slowest->at)) slowest = &x;
    if (x.msg == "version committed on node") b.copy_s = std::max(b.copy_s, x.Num("copy_s"));
    if (x.msg == committed_msg) committed = std::min(committed, x.at);
  }
  if (slowest == nullptr) return b;
  const absl::Time exec_start = slowest->at - absl::Seconds(slowest->Num("seconds"));
  b.setup_s = absl::ToDoubleSeconds(exec_start - start) + slowest->Num("staging_s") + slowest->Num("setup_s");
  b.digest_s = slowest->Num("digest_s");
  b.transfer_s = slowest->Num("buckets_s") - b.digest_s;
  b.commit_s = absl::ToDoubleSeconds(committed - slowest->at);
  b.apply_s = std::max(0.0, absl::ToDoubleSeconds(end - committed));
  return b;
}

std::string BreakdownJson(const std::string& name, const Breakdown& b) {
  return absl::StrFormat("\"%s\":{\"setup_s\":%.4f,\"transfer_s\":%.4f,\"digest_s\":%.4f,\"commit_s\":%.4f,\"live_copy_s\":%.4f,\"apply_s\":%.4f}",
                         name, b.setup_s, b.transfer_s, b.digest_s, b.commit_s, b.copy_s, b.apply_s);
}

std::string BreakdownText(const std::string& name, const Breakdown& b) {
  return absl::StrFormat("  %-15s setup %.3f  transfer %.3f  digest %.3f  commit %.3f (live copy %.3f)  apply %.3f\n", name, b.setup_s,
                         b.transfer_s, b.digest_s, b.commit_s, b.copy_s, b.apply_s);
}

struct Result {
  std::string mode;
  double update_s = 0, same_node_s = 0, peer_s = 0;
  Breakdown update, same_node, peer;
  int64_t model_bytes = 0;
  bool verified = false;
  std::string error;
};

pb::Mode ModeOf(const std::string& m) {
  return m == "sync" ? pb::MODE_SYNC : m == "async" ? pb::MODE_ASYNC : pb::MODE_ONE_STEP_OFF;
}

grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode == pb::MODE_SYNC) {
    pb::WaitVersionResponse resp;
    return WaitVersionAs(r, "qwen", v, 590000, &resp);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  pb::ApplyRequest req;
  req.set_model_id("qwen");
  req.set_worker_id(r.id);
  req.set_version(v);
  req.set_timeout_ms(590000);
  pb::ApplyResponse resp;
  return r.stub->Apply(&ctx, req, &resp);
}

Result RunMode(const std::string& mode_name, const std::string& config_json) {
  Result res;
  res.mode = mode_name;
  const pb::Mode mode = ModeOf(mode_name);
  auto config = planner::ParseHfConfig(config_json);
  if (!config.ok()) return res.error = config.status().ToString(), res;
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  if (!inv.ok()) return res.error = inv.status().ToString(), res;
  for (const planner::TensorSpec& t : inv->tensors) {
    int64_t n = planner::DTypeSize(t.dtype);
    for (int64_t d : t.shape) n *= d;
    res.model_bytes += n;
  }
  Cluster c;
  c.StartCoordinator(absl::Seconds(10), "127.0.0.1:0", [](ServerOptions& o) {
    o.transfer_timeout = absl::Minutes(5);
    o.bucket_bytes = int64_t{2} << 30;
  });
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec;
  spec.set_model_id("qwen");
  spec.set_hf_config_json(config_json);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(2);
  spec.set_mode(mode);
  spec.set_strategy(pb::STRATEGY_WEIGHTBRIDGE);
  auto add = [&](const std::string& id, pb::Role role, int node, const std::string& preset, int rank,
                 bool touch = false) -> absl::StatusOr<TestWorker*> {
    planner::ParallelConfig pc;
    pc.preset = preset;
    pb::ParallelConfig ppc;
    ppc.set_preset(preset);
    ppc.set_rank(rank);
    if (preset == "megatron") {
      pc.tp = 2;
      ppc.set_tp(2);
    } else {
      pc.replicas = 4;
      ppc.set_replicas(4);
      pc.quantization = absl::GetFlag(FLAGS_quantization);
      ppc.set_quantization(pc.quantization);
    }
    auto layout = planner::MakePresetLayout(*config, *inv, pc, rank);
    if (!layout.ok()) return layout.status();
    TestWorker& w = c.AddWorker(id, role, node, &*inv, layout->layout);
    // A late engine's weights are allocated memory (random init or an old checkpoint), not fresh
    // pages: touch them, or the catch-up's copy would be timed faulting them in.
    if (touch) std::memset(w.seg.data(), 0, static_cast<size_t>(w.seg.size()));
    grpc::Status s = c.Register(w, spec, &ppc);
    if (!s.ok()) return absl::InternalError(absl::StrCat("register ", id, ": ", s.error_message()));
    return &w;
  };
  std::vector<TestWorker*> trainers, rollouts;
  for (int r = 0; r < 2; ++r) {
    auto w = add(absl::StrCat("t", r), pb::ROLE_TRAINER, 0, "megatron", r);
    if (!w.ok()) return res.error = w.status().ToString(), c.Stop(), res;
    trainers.push_back(*w);
  }
  for (int r = 0; r < 2; ++r) {
    auto w = add(absl::StrCat("r", r), pb::ROLE_ROLLOUT, 1, "vllm", r);
    if (!w.ok()) return res.error = w.status().ToString(), c.Stop(), res;
    rollouts.push_back(*w);
  }
  for (uint64_t v : {1u, 2u}) {
    for (TestWorker* t : trainers) Fill(*t, v);
    const absl::Time start = absl::Now();
    // (Cluster::Publish fills the trainers again: the fill is done above, outside the timed window.)
    std::vector<grpc::Status> st;
    {
      if (mode == pb::MODE_SYNC) {
        for (TestWorker* r : rollouts) {
          grpc::ClientContext ctx;
          pb::BeginUpdateRequest req;
          req.set_model_id("qwen");
          req.set_worker_id(r->id);
          pb::BeginUpdateResponse resp;
          r->stub->BeginUpdate(&ctx, req, &resp);
        }
      }
      std::vector<std::thread> th;
      st.resize(trainers.size());
      for (size_t i = 0; i < trainers.size(); ++i) {
        th.emplace_back([&, i] {
          grpc::ClientContext ctx;
          pb::PublishRequest req;
          req.set_model_id("qwen");
          req.set_worker_id(trainers[i]->id);
          req.set_version(v);
          req.set_timeout_ms(590000);
          pb::PublishResponse resp;
          st[i] = trainers[i]->stub->Publish(&ctx, req, &resp);
        });
      }
      for (auto& t : th) t.join();
    }
    for (const grpc::Status& s : st) {
      if (!s.ok()) return res.error = absl::StrCat("publish v", v, ": ", s.error_message()), c.Stop(), res;
    }
    for (TestWorker* r : rollouts) {
      grpc::Status s = Receive(c, *r, mode, v);
      if (!s.ok()) return res.error = absl::StrCat(r->id, " v", v, ": ", s.error_message()), c.Stop(), res;
    }
    const absl::Time end = absl::Now();
    res.update_s = absl::ToDoubleSeconds(end - start);
    if (v == 2) res.update = BreakdownOf(start, end, v, "version committed");
  }
  res.verified = true;
  for (auto [id, node, rank, out, parts] : {std::tuple{"late_n1", 1, 2, &res.same_node_s, &res.same_node},
                                            std::tuple{"late_n0", 0, 3, &res.peer_s, &res.peer}}) {
    auto w = add(id, pb::ROLE_ROLLOUT, node, "vllm", rank, /*touch=*/true);
    if (!w.ok()) return res.error = w.status().ToString(), c.Stop(), res;
    const absl::Time start = absl::Now();
    grpc::Status s = Receive(c, **w, mode, 2);
    const absl::Time end = absl::Now();
    *out = absl::ToDoubleSeconds(end - start);
    *parts = BreakdownOf(start, end, 2, "catch-up committed");
    if (!s.ok()) return res.error = absl::StrCat(id, ": ", s.error_message()), c.Stop(), res;
    if (absl::GetFlag(FLAGS_quantization).empty()) {
      res.verified &= CountBad(**w, 2) == 0;
    } else {
      // Quantised: no canonical bytes to compare with; replica r0 (the same layout, every rank a
      // whole replica) holds version 2 as the normal path landed it, and the late replica must
      // hold exactly that (its bytes are copies of r0's / r1's quantised elements and scales).
      const TestWorker& ref = *rollouts[0];
      const bool same = ref.seg.size() == (*w)->seg.size() && std::memcmp(ref.seg.data(), (*w)->seg.data(), ref.seg.size()) == 0;
      const uint8_t* b = static_cast<const uint8_t*>(ref.seg.data());
      res.verified &= same && std::any_of(b, b + ref.seg.size(), [](uint8_t x) { return x != 0; });
    }
  }
  c.Stop();
  return res;
}

int Run() {
  std::ifstream f(absl::GetFlag(FLAGS_config));
  std::stringstream ss;
  ss << f.rdbuf();
  if (!f || ss.str().empty()) {
    std::fprintf(stderr, "bench/catch_up: cannot read --config=%s (run from the repository root)\n", absl::GetFlag(FLAGS_config).c_str());
    return 2;
  }
  bool ok = true;
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("%-13s %9s %10s %12s %10s %11s %9s %9s\n", "mode", "model_GB", "update_s", "same_node_s", "ratio", "peer_s", "ratio", "verified");
  }
  const std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& m : modes) {
    Result r = RunMode(m, ss.str());
    ok &= r.verified && r.error.empty();
    const double a = r.update_s > 0 ? r.same_node_s / r.update_s : 0, b = r.update_s > 0 ? r.peer_s / r.update_s : 0;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("{\"mode\":\"%s\",\"quantization\":\"%s\",\"model_bytes\":%lld,\"update_s\":%.4f,\"same_node_catch_up_s\":%.4f,\"same_node_ratio\":%.3f,"
                  "\"peer_catch_up_s\":%.4f,\"peer_ratio\":%.3f,\"verified\":%s,\"error\":\"%s\",%s,%s,%s}\n",
                  r.mode.c_str(), absl::GetFlag(FLAGS_quantization).c_str(), static_cast<long long>(r.model_bytes), r.update_s, r.same_node_s, a, r.peer_s, b,
                  r.verified ? "true" : "false", r.error.c_str(), BreakdownJson("update_parts", r.update).c_str(),
                  BreakdownJson("same_node_parts", r.same_node).c_str(), BreakdownJson("peer_parts", r.peer).c_str());
    } else {
      std::printf("%-13s %9.3f %10.3f %12.3f %10.2f %11.3f %9.2f %9s\n", r.mode.c_str(), r.model_bytes / 1e9, r.update_s, r.same_node_s, a,
                  r.peer_s, b, r.verified ? "yes" : "NO");
      std::printf("%s%s%s", BreakdownText("update", r.update).c_str(), BreakdownText("same-node", r.same_node).c_str(),
                  BreakdownText("peer", r.peer).c_str());
      if (!r.error.empty()) std::printf("  error: %s\n", r.error.c_str());
    }
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace wb::daemon

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  wb::daemon::Tap().Start();
  return wb::daemon::Run();
}

// bench/e2e: update time of Qwen2.5-0.5B (real config, 0.494B parameters, bf16) across two node
// daemons, with WeightBridge's plan and with the rank0_broadcast baseline executed for real on
// the same machinery (same daemons, same transports, same workers).
//
//   bazel run -c opt //bench:e2e [-- --json] [-- --versions=3 --replicas=2]
//   profiling: --baseline=false (WeightBridge only), --daemon_flags=--checksums=false,...
//   sender-side quantisation: --quantization=fp8_block128 (inter-node bytes of bf16 rollouts against
//   rollouts quantised on the sending node, one cluster, same run; default config
//   bench/testdata/qwen2-wide-8l.json, whose Megatron tp=2 shards hold whole 128x128 blocks)
//   lossless deltas: --delta [--lr=1e-6] (full versions against deltas, one run: bytes_full,
//   bytes_delta, full_s, delta_s, identical_fraction, verified); with --quantization=P the rollouts
//   hold preset P in both cases (nvfp4: deltas of the bf16 bytes, quantised by the rollout's node;
//   the printed floors assume bf16 rollouts)
//   end-to-end digests' cost: --digest_cost [--digest_rounds=3 --digest_settings=none,digests] (update
//   time with no check against digests on, interleaved rounds of fresh clusters; also: checksums,
//   digests_after_buckets, digests_from_memory)
//
// Setup: a coordinator and two node daemons (`weightbridged`, separate processes, loopback TCP
// between nodes). Node n0: Megatron tp=2 trainer ranks; node n1: vLLM tp=2 rollout replicas
// (2 by default, so WeightBridge's per-node dedup + intra-node relay has something to save).
// Sync mode: a version's update time is from the moment it can start (every trainer published
// it, every rollout paused) until every worker saw it committed into the rollouts' live weights. Each strategy runs
// --versions versions; the first warms up (plans, connections) and the median of the others is
// reported. Every rollout byte of every version is checked against the canonical weights.
//
// Output: a table (or one JSON object with --json: weightbridge_s, rank0_broadcast_s,
// bytes_weightbridge, bytes_rank0_broadcast, verified, plus details), next to the host
// transport's limits measured in the same run: TCP loopback GB/s (one stream) and memcpy GB/s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "daemon/delta/update_model.h"
#include "daemon/metrics_scrape.h"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(int, versions, 4, "versions per strategy (the first is a warm-up)");
ABSL_FLAG(int, replicas, 0, "vLLM tp=2 replicas on the rollout node (0: 2, with --delta 1)");
ABSL_FLAG(std::string, config, "", "HF config.json (default: tests/e2e/testdata/qwen2.5-0.5b.json)");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "extra weightbridged flags for every daemon, comma-separated (e.g. --bucket_bytes=268435456,--checksums=false)");
ABSL_FLAG(bool, baseline, true, "also run the rank0_broadcast baseline (false: WeightBridge only, e.g. while profiling)");
ABSL_FLAG(bool, digest_cost, false,
          "instead: the cost of end-to-end digests (issue 17.4): WeightBridge's update time under the integrity settings "
          "of --digest_settings, one fresh cluster per setting and round, the settings interleaved over --digest_rounds "
          "rounds (order reversed every other round); medians of every steady version and per-round ratios");
ABSL_FLAG(int, digest_rounds, 3, "--digest_cost: rounds (each runs every setting once, on a fresh cluster)");
ABSL_FLAG(std::string, node_logs_dir, "", "--delta: copy every node daemon's log of each case into this directory (<case>-node<i>.log) before the cluster stops, for the per-version timings of its \"version transferred\" lines");
ABSL_FLAG(bool, digest_logs, false, "--digest_cost: also print every node's \"version transferred\" log lines to stderr");
ABSL_FLAG(std::vector<std::string>, digest_settings, std::vector<std::string>({"none", "digests"}),
          "--digest_cost: settings to compare, first = the reference: none (no digests, no per-batch checksums), "
          "checksums (per-batch checksums only), digests_after_buckets (--digest_overlap=false), digests_from_memory (--digest_in_transport=false: "
          "the node hashes what host_tcp moved from memory), digests (the default)");

ABSL_FLAG(bool, delta, false,
          "lossless deltas: one cluster without and one with --delta_cache_bytes, trainers publishing versions in which the "
          "update model's share of bf16 elements changes at --lr (docs/daemon.md \"Deltas\"); prints bytes_full, bytes_delta, "
          "full_s, delta_s, identical_fraction, verified");
ABSL_FLAG(double, link_gbps, 0,
          "emulate a NIC of this many Gb/s between the nodes: every daemon runs with --max_send_gbps (host_tcp egress "
          "cap, transport/host_tcp/send_pacer.h); 0 = plain loopback");
ABSL_FLAG(double, lr, 1e-6, "--delta: learning rate of the update model (daemon/delta/update_model.h)");
ABSL_FLAG(std::string, quantization, "",
          "instead: inter-node bytes and update time of WeightBridge into bf16 rollouts and into rollouts of this "
          "quantization preset (fp8_block128, mxfp8, nvfp4, w4a16_g32), quantised on the sending node where the trainer shards hold "
          "whole blocks (issue 17.1); one cluster, same run. With --delta: the delta bench into rollouts of the preset");

namespace wb::bench {
namespace {

namespace pb = ::weightbridge::v1;
using e2e::Cluster;
using e2e::Process;

struct StrategyResult {
  std::string strategy;
  std::vector<double> update_s;  // per version: all published + all paused -> all saw commit
  double median_s = 0;
  double daemon_transfer_s = 0;  // last version, as the coordinator measured it
  int64_t bytes_inter_node = 0;  // of the plan, per version
  int64_t bytes_intra_node = 0;
  int64_t bytes_moved = 0;  // coordinator's last_transfer_bytes
  int64_t wire_bytes_inter_node = 0;  // of the plan, per version, as moved (sender-side quantisation)
  bool verified = false;
  std::string error;
};

using e2e::Median;

// `quantization`: the rollouts' --quantization preset ("" = bf16 rollouts).
// `worker_flags`: extra flags of every worker (--delta: --delta_fraction).
StrategyResult RunStrategy(Cluster& cl, const std::string& strategy, const std::string& config,
                           int versions, int replicas, const std::string& quantization = "",
                           const std::vector<std::string>& worker_flags = {}) {
  StrategyResult res;
  res.strategy = strategy;
  e2e::RunOptions run;
  run.config = config;
  run.model_id = "qwen-" + strategy + (quantization.empty() ? "" : "-" + quantization);
  run.mode = "sync";
  run.strategy = strategy;
  run.versions = versions;
  run.timeout_ms = 300000;
  std::vector<e2e::WorkerSpec> trainer_specs, rollout_specs;
  for (int r = 0; r < 2; ++r) {
    e2e::WorkerSpec w{true, 0, "megatron", 2, 1, 1, 1, r, r};
    w.extra_flags = {"--populate"};
    w.extra_flags.insert(w.extra_flags.end(), worker_flags.begin(), worker_flags.end());
    trainer_specs.push_back(w);
  }
  for (int r = 0; r < 2 * replicas; ++r) {
    e2e::WorkerSpec w{false, 1, "vllm", 2, 1, 1, replicas, r, r};
    w.extra_flags = {"--populate"};
    if (!quantization.empty()) w.extra_flags.push_back("--quantization=" + quantization);
    w.extra_flags.insert(w.extra_flags.end(), worker_flags.begin(), worker_flags.end());
    rollout_specs.push_back(w);
  }
  auto workers = cl.RunWorkers(run, trainer_specs, rollout_specs, absl::Minutes(10), absl::Minutes(2));
  if (!workers.ok()) {
    res.error = workers.status().ToString();
    return res;
  }
  bool ok = workers->failures.empty();
  if (!ok) res.error = workers->failures.back().ToString();
  const int64_t model_bytes = e2e::ModelBytes(config);
  int64_t verified_last = 0, verified_elements = 0;
  for (Process* p : workers->rollouts) {
    if (!e2e::EventsNamed(p, "mismatch").empty()) ok = false;
    verified_last += e2e::VerifiedBytes(p, static_cast<uint64_t>(versions));
    verified_elements += e2e::VerifiedElements(p, static_cast<uint64_t>(versions));
  }
  // Each rollout checked every byte of its pieces; together the replicas hold at least the whole
  // model per replica (more where vLLM replicates norms across tp ranks).
  res.verified = ok && verified_last >= static_cast<int64_t>(replicas) * model_bytes;
  if (ok && !res.verified) {
    res.error = absl::StrCat("only ", verified_last, " bytes verified for the last version, want >= ",
                             static_cast<int64_t>(replicas) * model_bytes);
  }
  // Per version: every trainer published + every rollout paused -> every worker saw it committed
  // (e2e::UpdateWindow).
  for (int v = 1; v <= versions; ++v) {
    res.update_s.push_back(e2e::UpdateWindow(workers->trainers, workers->rollouts, static_cast<uint64_t>(v)).seconds());
  }
  std::vector<double> steady(res.update_s.begin() + (versions > 1 ? 1 : 0), res.update_s.end());
  res.median_s = Median(steady);
  auto status = cl.Status();
  if (status.ok()) {
    for (const auto& m : status->models()) {
      if (m.model_id() != run.model_id) continue;
      res.daemon_transfer_s = m.last_transfer_seconds();
      res.bytes_moved = static_cast<int64_t>(m.last_transfer_bytes());
      res.bytes_inter_node = m.plan_stats().bytes_inter_node();
      res.bytes_intra_node = m.plan_stats().bytes_intra_node();
      res.wire_bytes_inter_node = m.plan_stats().wire_bytes_inter_node();
    }
  }
  if (!quantization.empty()) {
    // A quantised replica stores fewer bytes than the bf16 model (and what crossed may be bf16:
    // NVFP4 is quantised by the receiving node), so count canonical elements: the rollouts checked
    // every element of their pieces, at least the model's elements per replica.
    const int64_t want = static_cast<int64_t>(replicas) * (model_bytes / 2);
    res.verified = ok && want > 0 && verified_elements >= want;
    if (res.verified) res.error.clear();  // the bf16 threshold above does not apply
    if (ok && !res.verified) res.error = absl::StrCat("only ", verified_elements, " elements verified for the last version, want >= ", want);
  }
  return res;
}

// One TCP stream over loopback: the host transport's raw limit on this machine.
double TcpLoopbackGBps(int64_t bytes) {
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (lfd < 0 || ::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(lfd, 1) != 0 || ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return 0;
  }
  std::thread receiver([lfd, bytes] {
    int c = ::accept(lfd, nullptr, nullptr);
    std::vector<char> buf(4 << 20);
    int64_t got = 0;
    while (got < bytes) {
      ssize_t n = ::read(c, buf.data(), buf.size());
      if (n <= 0) break;
      got += n;
    }
    ::close(c);
  });
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(s);
    receiver.join();
    return 0;
  }
  std::vector<char> buf(4 << 20, 1);
  absl::Time start = absl::Now();
  int64_t sent = 0;
  while (sent < bytes) {
    ssize_t n = ::write(s, buf.data(), std::min<int64_t>(buf.size(), bytes - sent));
    if (n <= 0) break;
    sent += n;
  }
  ::close(s);
  receiver.join();
  ::close(lfd);
  return static_cast<double>(sent) / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
}

double MemcpyGBps(int64_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::memcpy(b.data(), a.data(), bytes);  // fault pages in
  absl::Time start = absl::Now();
  for (int i = 0; i < 3; ++i) std::memcpy(b.data(), a.data(), bytes);
  return 3.0 * static_cast<double>(bytes) / absl::ToDoubleSeconds(absl::Now() - start) / 1e9;
}

// This host's memory bandwidth with every hardware thread (at most 8; best of 3 over `bytes`):
// reading, as the delta codec's passes over source, base and landed staging do, and copying, as
// the commit's live copy does. --delta's physical floors come from these.
struct HostMemory {
  double read_GBps = 0, copy_GBps = 0;
  int threads = 0;
};
HostMemory MeasureHostMemory(int64_t bytes) {
  HostMemory m;
  m.threads = std::clamp<int>(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
  std::vector<uint64_t> a(static_cast<size_t>(bytes) / 8, 0x0101010101010101ULL), b(a.size(), 0);
  std::atomic<uint64_t> sink{0};
  auto best_of_3 = [&](const std::function<void(size_t, size_t)>& part) {
    double best = 0;
    for (int r = 0; r < 3; ++r) {
      const absl::Time start = absl::Now();
      std::vector<std::thread> ts;
      for (int t = 0; t < m.threads; ++t) ts.emplace_back([&, t] { part(a.size() * t / m.threads, a.size() * (t + 1) / m.threads); });
      for (std::thread& th : ts) th.join();
      best = std::max(best, static_cast<double>(bytes) / absl::ToDoubleSeconds(absl::Now() - start) / 1e9);
    }
    return best;
  };
  m.copy_GBps = best_of_3([&](size_t lo, size_t hi) { std::memcpy(b.data() + lo, a.data() + lo, (hi - lo) * 8); });
  m.read_GBps = best_of_3([&](size_t lo, size_t hi) {
    // glibc's memchr reads with the CPU's widest loads (as the codec and XXH3 do); no byte is 0,
    // so it reads the whole range. A scalar loop reads ~30% slower here.
    sink += std::memchr(a.data() + lo, 0, (hi - lo) * 8) == nullptr ? 1 : 0;
  });
  return m;
}

// A coordinator + 2 node daemons for one measurement (--daemon_flags and `extra` passed to them).
struct BenchCluster {
  std::unique_ptr<e2e::Harness> harness;  // owns the processes: destroyed after `cluster`
  std::unique_ptr<Cluster> cluster;
};
absl::StatusOr<BenchCluster> StartBenchCluster(const std::string& tag, const std::vector<std::string>& extra, bool node_metrics = false) {
  BenchCluster out;
  ASSIGN_OR_RETURN(out.harness, e2e::Harness::Create(tag));
  e2e::ClusterOptions copts;
  copts.num_nodes = 2;
  copts.lease_ms = 10000;
  copts.transfer_timeout_ms = 300000;
  copts.node_metrics = node_metrics;
  copts.extra_daemon_flags = absl::GetFlag(FLAGS_daemon_flags);
  copts.extra_daemon_flags.insert(copts.extra_daemon_flags.end(), extra.begin(), extra.end());
  if (absl::GetFlag(FLAGS_link_gbps) > 0) copts.extra_daemon_flags.push_back(absl::StrCat("--max_send_gbps=", absl::GetFlag(FLAGS_link_gbps)));
  ASSIGN_OR_RETURN(out.cluster, Cluster::Start(out.harness.get(), copts));
  return out;
}

// Per version of `model`, from the node daemons' "version transferred" log lines: the most
// seconds any node spent hashing after the last bucket (digest_s: what the digests add to the
// update directly; hashing during the buckets only competes for CPU), and summed over the nodes
// the CPU seconds spent hashing from memory (sources, landed boxes) and the bytes digested
// from host_tcp's hashes as they crossed. Versions with no line are absent.
struct DigestFigures {
  double tail_s = 0, source_hash_s = 0, landed_hash_s = 0, bytes = 0, transport_bytes = 0;
};
std::map<uint64_t, DigestFigures> DigestTailSeconds(const Cluster& cl, int num_nodes, const std::string& model) {
  std::map<uint64_t, DigestFigures> out;
  for (int i = 0; i < num_nodes; ++i) {
    std::ifstream in(cl.node(i)->log_path());
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("msg=\"version transferred\"") == std::string::npos || line.find(" model=" + model + " ") == std::string::npos) continue;
      auto field = [&](const std::string& key) -> std::optional<double> {
        const size_t at = line.find(" " + key + "=");
        if (at == std::string::npos) return std::nullopt;
        double v = 0;
        if (!absl::SimpleAtod(absl::string_view(line).substr(at + key.size() + 2, line.find(' ', at + 1) - at - key.size() - 2), &v)) return std::nullopt;
        return v;
      };
      const std::optional<double> version = field("version"), digest_s = field("digest_s");
      if (!version || !digest_s) continue;
      if (absl::GetFlag(FLAGS_digest_logs)) std::fprintf(stderr, "bench/e2e: node %d: %s\n", i, line.c_str());
      DigestFigures& d = out[static_cast<uint64_t>(*version)];
      d.tail_s = std::max(d.tail_s, *digest_s);
      d.source_hash_s += field("digest_source_hash_s").value_or(0);
      d.landed_hash_s += field("digest_landed_hash_s").value_or(0);
      d.bytes += field("digest_bytes").value_or(0);
      d.transport_bytes += field("digest_transport_bytes").value_or(0);
    }
  }
  return out;
}

// --digest_cost: WeightBridge's update time under integrity settings (--digest_settings; the first
// is the reference, by default none against the default digests). On a shared, noisy host one
// cluster per setting measured back to back confounds the setting with whatever else ran then, so
// the settings are interleaved: --digest_rounds rounds, each starting a fresh cluster for every
// setting, in reverse order every other round (A B, B A, A B, ...), so drift in the host's load
// hits both alike. Reported per setting: the median of every steady version (all rounds pooled)
// and each round's median; the overhead as the ratio of pooled medians and as the median of the
// per-round ratios (each round's pair ran minutes apart at most).
int RunDigestCost(const std::string& config, int versions, int replicas, bool json) {
  const std::map<std::string, std::vector<std::string>> known = {
      {"none", {"--digests=false", "--checksums=false"}},
      {"checksums", {"--digests=false", "--checksums=true"}},
      {"digests_after_buckets", {"--digests=true", "--checksums=false", "--digest_overlap=false"}},
      {"digests_from_memory", {"--digests=true", "--checksums=false", "--digest_overlap=true", "--digest_in_transport=false"}},
      {"digests", {"--digests=true", "--checksums=false", "--digest_overlap=true"}}};
  struct Setting {
    std::string name;
    std::vector<std::string> flags;
    std::vector<double> steady;               // every steady version's update time, all rounds
    std::vector<double> round_s;              // per round: median of its steady versions (0: the round failed)
    std::vector<std::vector<double>> update_s;  // per round: every version
    std::vector<double> tail_s;               // every steady version: hashing left after the buckets (slowest node)
    std::vector<double> source_hash_s, landed_hash_s, transport_share;  // every steady version, both nodes
    bool verified = true;
    std::string error;
  };
  std::vector<Setting> settings;
  for (const std::string& name : absl::GetFlag(FLAGS_digest_settings)) {
    auto f = known.find(name);
    if (f == known.end()) {
      std::fprintf(stderr, "bench/e2e: unknown --digest_settings entry '%s' (none, checksums, digests_after_buckets, digests_from_memory, digests)\n", name.c_str());
      return 2;
    }
    settings.push_back({name, f->second, {}, {}, {}, {}, {}, {}, {}, true, {}});
  }
  if (settings.size() < 2) {
    std::fprintf(stderr, "bench/e2e: --digest_settings needs at least two settings\n");
    return 2;
  }
  const int rounds = std::max(1, absl::GetFlag(FLAGS_digest_rounds));
  for (int r = 0; r < rounds; ++r) {
    std::vector<Setting*> order;
    for (Setting& st : settings) order.push_back(&st);
    if (r % 2 == 1) std::reverse(order.begin(), order.end());
    for (Setting* st : order) {
      auto bc = StartBenchCluster(absl::StrCat("bench-e2e-", st->name, "-r", r), st->flags);
      if (!bc.ok()) {
        std::fprintf(stderr, "bench/e2e: cluster (%s, round %d): %s\n", st->name.c_str(), r + 1, bc.status().ToString().c_str());
        return 1;
      }
      if (!json) std::fprintf(stderr, "bench/e2e: round %d/%d, integrity setting '%s' (%s)...\n", r + 1, rounds, st->name.c_str(),
                              absl::StrJoin(st->flags, " ").c_str());
      StrategyResult res = RunStrategy(*bc->cluster, "weightbridge", config, versions, replicas);
      for (const auto& [v, t] : DigestTailSeconds(*bc->cluster, 2, "qwen-weightbridge")) {
        if (v <= 1) continue;
        st->tail_s.push_back(t.tail_s);
        st->source_hash_s.push_back(t.source_hash_s);
        st->landed_hash_s.push_back(t.landed_hash_s);
        st->transport_share.push_back(t.bytes > 0 ? t.transport_bytes / t.bytes : 0);
      }
      bc->harness->KillAll();
      // A round that failed (a worker timed out on the loaded host, a byte not verified) counts in
      // no figure: its versions are missing or not comparable. It is reported, and so is the count.
      bool ok = res.verified && res.error.empty() && static_cast<int>(res.update_s.size()) == versions;
      for (double x : res.update_s) ok = ok && x > 0;
      st->verified = st->verified && res.verified;
      if (!res.error.empty()) st->error = absl::StrCat("round ", r + 1, ": ", res.error);
      st->update_s.push_back(res.update_s);
      st->round_s.push_back(ok ? res.median_s : 0);
      if (ok) st->steady.insert(st->steady.end(), res.update_s.begin() + (res.update_s.size() > 1 ? 1 : 0), res.update_s.end());
      std::fprintf(stderr, "bench/e2e: round %d %s: %s median %.3f s, versions %s\n", r + 1, st->name.c_str(), ok ? "ok" : "FAILED",
                   res.median_s, absl::StrJoin(res.update_s, " ", [](std::string* o, double x) { absl::StrAppendFormat(o, "%.3f", x); }).c_str());
    }
  }
  const Setting& ref = settings[0];
  const double ref_s = ref.steady.empty() ? 0 : Median(ref.steady);
  bool verified = true;
  for (const Setting& st : settings) verified = verified && st.verified && !st.steady.empty();
  // Per setting: pooled median, overhead against the reference (pooled), and the median of the
  // per-round ratios.
  struct Figures {
    double median_s = 0, overhead = 0, overhead_paired = 0;
    std::vector<double> round_ratio;  // rounds where both ran
    int rounds_ok = 0;
  };
  std::vector<Figures> figs;
  for (const Setting& st : settings) {
    Figures f;
    f.median_s = st.steady.empty() ? 0 : Median(st.steady);
    for (double x : st.round_s) f.rounds_ok += x > 0 ? 1 : 0;
    f.overhead = ref_s > 0 ? f.median_s / ref_s - 1 : 0;
    for (size_t r = 0; r < st.round_s.size() && r < ref.round_s.size(); ++r) {
      if (ref.round_s[r] > 0 && st.round_s[r] > 0) f.round_ratio.push_back(st.round_s[r] / ref.round_s[r]);
    }
    f.overhead_paired = f.round_ratio.empty() ? 0 : Median(f.round_ratio) - 1;
    figs.push_back(std::move(f));
  }
  if (json) {
    nlohmann::json j = {{"reference", ref.name}, {"verified", verified}, {"rounds", rounds}, {"model_bytes", e2e::ModelBytes(config)},
                        {"replicas", replicas}, {"versions", versions}};
    for (size_t i = 0; i < settings.size(); ++i) {
      const Setting& st = settings[i];
      j[st.name + "_s"] = figs[i].median_s;
      j[st.name + "_round_s"] = st.round_s;
      j[st.name + "_update_s"] = st.update_s;
      j[st.name + "_rounds_ok"] = figs[i].rounds_ok;
      if (!st.tail_s.empty()) {
        j[st.name + "_digest_tail_s"] = Median(st.tail_s);
        // Where the hashing went (medians over steady versions, both nodes): CPU seconds hashing
        // sources / landed boxes from memory, and the share of digested bytes host_tcp hashed.
        j[st.name + "_source_hash_s"] = Median(st.source_hash_s);
        j[st.name + "_landed_hash_s"] = Median(st.landed_hash_s);
        j[st.name + "_transport_hashed"] = Median(st.transport_share);
      }
      if (i > 0) {
        // digest_overhead / digest_overhead_paired for "digests" (the default against the reference).
        const std::string key = st.name == "digests" ? std::string("digest_overhead") : st.name + "_overhead";
        j[key] = figs[i].overhead;
        j[key + "_paired"] = figs[i].overhead_paired;
        j[st.name + "_round_ratio"] = figs[i].round_ratio;
      }
      if (!st.error.empty()) j[st.name + "_error"] = st.error;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s (%.3f GB bf16), WeightBridge, sync, %d round(s) x %d versions (steady = v2..), %d replica(s)\n", config.c_str(),
                e2e::ModelBytes(config) / 1e9, rounds, versions, replicas);
    std::printf("%-22s %10s %-44s %10s %10s %12s %9s\n", "integrity", "median_s", "per-round median_s (0: failed)", "overhead",
                "paired", "digest_tail_s", "verified");
    for (size_t i = 0; i < settings.size(); ++i) {
      const Setting& st = settings[i];
      std::vector<std::string> rs;
      for (double x : st.round_s) rs.push_back(absl::StrFormat("%.3f", x));
      std::printf("%-22s %10.3f %-44s %9.1f%% %9.1f%% %12.3f %9s\n", st.name.c_str(), figs[i].median_s, absl::StrJoin(rs, " ").c_str(),
                  100 * figs[i].overhead, 100 * figs[i].overhead_paired, st.tail_s.empty() ? 0.0 : Median(st.tail_s),
                  st.verified ? "yes" : "NO");
      if (!st.error.empty()) std::printf("  error: %s\n", st.error.c_str());
    }
    std::printf("overhead = pooled median / %s's - 1; paired = median over rounds of (round median / %s's round median) - 1;\n"
                "digest_tail_s = median over steady versions of the slowest node's hashing after its last bucket\n",
                ref.name.c_str(), ref.name.c_str());
  }
  return verified ? 0 : 1;
}

// --quantization: bf16 rollouts, then rollouts of the preset, each with the same trainers on one
// cluster (node metrics on). Inter-node bytes are measured: the host_tcp payload the rollout node
// received (wb_nic_bytes_total) over each run, per version; next to the plan's wire bytes.
int RunQuantization(const std::string& quantization, const std::string& config, int versions, int replicas, bool json) {
  auto bc = StartBenchCluster("bench-e2e-quant", {}, /*node_metrics=*/true);
  if (!bc.ok()) {
    std::fprintf(stderr, "bench/e2e: cluster: %s\n", bc.status().ToString().c_str());
    return 1;
  }
  auto received = [&]() -> double {
    auto m = daemon::ScrapeMetrics(bc->cluster->node_metrics_port(1), absl::Seconds(10));
    return m.ok() ? daemon::MetricSum(*m, "wb_nic_bytes_total", "direction=\"received\"") : -1;
  };
  struct Case {
    std::string name, quantization;
    StrategyResult result;
    double nic_bytes = 0;  // per version, measured
  };
  std::vector<Case> cases = {{"bf16", "", {}}, {quantization, quantization, {}}};
  for (Case& c : cases) {
    if (!json) std::fprintf(stderr, "bench/e2e: rollouts in %s...\n", c.name.c_str());
    const double before = received();
    c.result = RunStrategy(*bc->cluster, "weightbridge", config, versions, replicas, c.quantization);
    const double after = received();
    c.nic_bytes = before >= 0 && after >= 0 ? (after - before) / versions : -1;
  }
  bc->harness->KillAll();
  const Case& b = cases[0];
  const Case& q = cases[1];
  const double ratio = b.nic_bytes > 0 ? q.nic_bytes / b.nic_bytes : 0;
  const double plan_ratio = b.result.wire_bytes_inter_node > 0 ? static_cast<double>(q.result.wire_bytes_inter_node) / b.result.wire_bytes_inter_node : 0;
  const bool verified = b.result.verified && q.result.verified;
  if (json) {
    nlohmann::json j = {{"quantization", quantization},
                        {"config", config},
                        {"model_bytes", e2e::ModelBytes(config)},
                        {"replicas", replicas},
                        {"versions", versions},
                        {"inter_node_bytes_bf16", b.nic_bytes},
                        {"inter_node_bytes_quantized", q.nic_bytes},
                        {"inter_node_ratio", ratio},
                        {"plan_wire_bytes_inter_node_bf16", b.result.wire_bytes_inter_node},
                        {"plan_wire_bytes_inter_node_quantized", q.result.wire_bytes_inter_node},
                        {"plan_ratio", plan_ratio},
                        {"update_s_bf16", b.result.median_s},
                        {"update_s_quantized", q.result.median_s},
                        {"update_s_bf16_versions", b.result.update_s},  // every version, the first warms up
                        {"update_s_quantized_versions", q.result.update_s},
                        {"verified", verified}};
    for (const Case* c : {&b, &q}) {
      if (!c->result.error.empty()) j["error_" + c->name] = c->result.error;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s (%.3f GB bf16), 2 Megatron tp=2 trainers on n0 -> %d vLLM tp=2 replica(s) on n1, sync, %d versions\n",
                config.c_str(), e2e::ModelBytes(config) / 1e9, replicas, versions);
    std::printf("%-14s %16s %16s %10s %9s\n", "rollouts", "inter_node_GB", "plan_wire_GB", "update_s", "verified");
    for (const Case* c : {&b, &q}) {
      std::printf("%-14s %16.3f %16.3f %10.3f %9s\n", c->name.c_str(), c->nic_bytes / 1e9, c->result.wire_bytes_inter_node / 1e9,
                  c->result.median_s, c->result.verified ? "yes" : "NO");
      if (!c->result.error.empty()) std::printf("  error: %s\n", c->result.error.c_str());
      std::printf("  per version (the first warms up): %s\n",
                  absl::StrJoin(c->result.update_s, " ", [](std::string* o, double x) { absl::StrAppendFormat(o, "%.3f", x); }).c_str());
    }
    std::printf("inter-node bytes %s / bf16: %.3fx (plan: %.3fx); update time %s / bf16: %.2fx\n", quantization.c_str(), ratio, plan_ratio,
                quantization.c_str(), b.result.median_s > 0 ? q.result.median_s / b.result.median_s : 0);
  }
  return verified ? 0 : 1;
}

// --delta: the same sync WeightBridge run (vLLM tp=2 replicas: --replicas, default 1) twice, each on a fresh cluster
// (node metrics on): full
// versions (no --delta_cache_bytes), then deltas (--delta_cache_bytes = 2x the model). Trainers
// publish versions in which the update model's share of bf16 elements changes at --lr (workers'
// --delta_fraction = 1 - identical_fraction); rollouts check every byte of every version.
// bytes_*: host_tcp payload the rollout node received per version (wb_nic_bytes_total); the delta
// run's first version has no base and goes in full, so bytes_delta = (its total - bytes_full) /
// (versions - 1). *_s: median update time of versions 3.. in both cases (at least 5 versions; the
// first two warm up: first touch of staging, of the delta regions and of the cache's second copy).
// `quantization`: the rollouts' preset in both cases ("" = bf16 rollouts).
int RunDelta(const std::string& config, int versions, int replicas, bool json, const std::string& quantization = "") {
  const double lr = absl::GetFlag(FLAGS_lr);
  absl::StatusOr<double> sampled = delta::SampleIdenticalFraction(lr);
  if (!sampled.ok()) {
    std::fprintf(stderr, "bench/e2e: %s\n", sampled.status().ToString().c_str());
    return 1;
  }
  const double identical = *sampled;
  const std::string fraction = absl::StrCat("--delta_fraction=", 1.0 - identical);
  // Times: the median of versions kSteadyFrom.. in both cases. Versions 1 (full in both, first
  // touch of staging) and 2 (the delta run's first delta version: first touch of its delta regions
  // and of the cache's second copy on a fresh daemon, seconds per GB on this VM) are warm-ups.
  constexpr int kSteadyFrom = 3;
  versions = std::max(versions, kSteadyFrom + 2);
  struct Case {
    std::string name;
    std::vector<std::string> daemon_flags;
    StrategyResult result;
    double nic_bytes = 0;  // over the whole run
  };
  const int64_t model_bytes = e2e::ModelBytes(config);
  std::vector<Case> cases = {{"full", {}, {}}, {"delta", {absl::StrCat("--delta_cache_bytes=", 2 * model_bytes)}, {}}};
  for (Case& c : cases) {
    auto bc = StartBenchCluster("bench-e2e-" + c.name, c.daemon_flags, /*node_metrics=*/true);
    if (!bc.ok()) {
      std::fprintf(stderr, "bench/e2e: cluster (%s): %s\n", c.name.c_str(), bc.status().ToString().c_str());
      return 1;
    }
    auto received = [&]() -> double {
      auto m = daemon::ScrapeMetrics(bc->cluster->node_metrics_port(1), absl::Seconds(10));
      return m.ok() ? daemon::MetricSum(*m, "wb_nic_bytes_total", "direction=\"received\"") : -1;
    };
    if (!json) std::fprintf(stderr, "bench/e2e: %s versions (lr %g, %s)...\n", c.name.c_str(), lr, fraction.c_str());
    const double before = received();
    c.result = RunStrategy(*bc->cluster, "weightbridge", config, versions, replicas, quantization, {fraction});
    const double after = received();
    c.nic_bytes = before >= 0 && after >= 0 ? after - before : -1;
    if (const std::string dir = absl::GetFlag(FLAGS_node_logs_dir); !dir.empty()) {
      for (int i = 0; i < 2; ++i) {
        std::ifstream in(bc->cluster->node(i)->log_path(), std::ios::binary);
        std::ofstream out(absl::StrCat(dir, "/", c.name, "-node", i, ".log"), std::ios::binary);
        out << in.rdbuf();
      }
    }
    bc->harness->KillAll();
  }
  const Case& f = cases[0];
  const Case& d = cases[1];
  auto steady = [&](const StrategyResult& r) {
    return r.update_s.size() >= static_cast<size_t>(kSteadyFrom)
               ? e2e::Median(std::vector<double>(r.update_s.begin() + (kSteadyFrom - 1), r.update_s.end()))
               : 0.0;
  };
  const double full_s = steady(f.result), delta_s = steady(d.result);
  const double bytes_full = f.nic_bytes / versions;
  const double bytes_delta = (d.nic_bytes - bytes_full) / (versions - 1);
  const bool verified = f.result.verified && d.result.verified;
  // Physical floors of one steady version on this host, where both nodes share one memory system
  // (on separate hosts the two nodes' reads would overlap): full = its bytes over the link
  // (loopback: at the kernel's TCP loopback rate) + the commit's copy into live weights; delta = the
  // sender's read of source and base, the receiver's read of the landed base (its digest covers
  // every byte), the streams over the link and the same commit copy.
  const HostMemory mem = MeasureHostMemory(int64_t{512} << 20);
  // Without --link_gbps the link is the kernel's TCP loopback (one stream, measured here too).
  const double tcp_GBps = absl::GetFlag(FLAGS_link_gbps) > 0 ? 0 : TcpLoopbackGBps(int64_t{1} << 30);
  const double link_Bps = absl::GetFlag(FLAGS_link_gbps) > 0 ? absl::GetFlag(FLAGS_link_gbps) * 1e9 / 8 : tcp_GBps * 1e9;
  const double copy_Bps = mem.copy_GBps * 1e9, read_Bps = mem.read_GBps * 1e9;
  auto link_s = [&](double bytes) { return bytes / link_Bps; };
  const double commit_s = model_bytes / copy_Bps;
  const double full_floor_s = link_s(bytes_full) + commit_s;
  const double delta_floor_s = 3.0 * model_bytes / read_Bps + link_s(bytes_delta) + commit_s;
  if (json) {
    nlohmann::json j = {{"lr", lr},
                        {"quantization", quantization},
                        {"link_gbps", absl::GetFlag(FLAGS_link_gbps)},
                        {"identical_fraction", identical},
                        {"bytes_full", bytes_full},
                        {"bytes_delta", bytes_delta},
                        {"bytes_ratio", bytes_full > 0 ? bytes_delta / bytes_full : 0},
                        {"full_s", full_s},
                        {"delta_s", delta_s},
                        {"time_ratio", full_s > 0 ? delta_s / full_s : 0},
                        {"times_median_from_version", kSteadyFrom},
                        {"host_read_GBps", mem.read_GBps},
                        {"host_copy_GBps", mem.copy_GBps},
                        {"host_threads", mem.threads},
                        {"tcp_loopback_GBps", tcp_GBps},
                        {"full_floor_s", full_floor_s},
                        {"delta_floor_s", delta_floor_s},
                        {"floor_time_ratio", delta_floor_s / full_floor_s},
                        {"full_to_floor", full_s / full_floor_s},
                        {"delta_to_floor", delta_s / delta_floor_s},
                        {"full_update_s", f.result.update_s},
                        {"delta_update_s", d.result.update_s},
                        {"config", config},
                        {"model_bytes", model_bytes},
                        {"replicas", replicas},
                        {"versions", versions},
                        {"verified", verified}};
    for (const Case* c : {&f, &d}) {
      if (!c->result.error.empty()) j["error_" + c->name] = c->result.error;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s (%.3f GB bf16), lr %g: %.4f of bf16 elements identical per version, %d replica(s), sync, %d versions\n", config.c_str(),
                model_bytes / 1e9, lr, identical, replicas, versions);
    std::printf("%-8s %16s %10s %9s\n", "versions", "inter_node_GB", "update_s", "verified");
    std::printf("%-8s %16.4f %10.3f %9s\n", "full", bytes_full / 1e9, full_s, f.result.verified ? "yes" : "NO");
    std::printf("%-8s %16.4f %10.3f %9s\n", "delta", bytes_delta / 1e9, delta_s, d.result.verified ? "yes" : "NO");
    std::printf("delta / full: %.2fx; physical floors on this host (%d threads: read %.1f GB/s, copy %.1f GB/s; both nodes share "
                "its memory): full %.3f s (update %.2fx it), delta %.3f s (update %.2fx it), floor ratio %.2fx\n",
                full_s > 0 ? delta_s / full_s : 0, mem.threads, mem.read_GBps, mem.copy_GBps, full_floor_s, full_s / full_floor_s,
                delta_floor_s, delta_s / delta_floor_s, delta_floor_s / full_floor_s);
    for (const Case* c : {&f, &d}) {
      if (!c->result.error.empty()) std::printf("  error (%s): %s\n", c->name.c_str(), c->result.error.c_str());
    }
  }
  return verified ? 0 : 1;
}

int Run() {
  const bool json = absl::GetFlag(FLAGS_json);
  const int versions = std::max(1, absl::GetFlag(FLAGS_versions));
  // 0 (unset): 2 replicas, 1 with --delta (its figures so far are of one replica).
  const int replicas_flag = absl::GetFlag(FLAGS_replicas);
  const int replicas = replicas_flag > 0 ? replicas_flag : 2;
  std::string config = absl::GetFlag(FLAGS_config);
  if (config.empty()) config = e2e::ModelConfigPath(/*full=*/true);
  if (const std::string q = absl::GetFlag(FLAGS_quantization); !q.empty()) {
    // With --delta: full against delta versions into rollouts of the preset (the default config).
    if (absl::GetFlag(FLAGS_delta)) return RunDelta(config, versions, replicas_flag > 0 ? replicas_flag : 1, json, q);
    if (absl::GetFlag(FLAGS_config).empty()) config = e2e::Runfile("bench/testdata/qwen2-wide-8l.json");
    return RunQuantization(q, config, versions, replicas, json);
  }
  if (absl::GetFlag(FLAGS_digest_cost)) return RunDigestCost(config, versions, replicas, json);
  // Default one replica. With two, WeightBridge sends each box to n1 once and relays it to the
  // other replica after n1's delta tail, so the relayed boxes travel as deltas too (docs/daemon.md
  // "Deltas", Relays): n1's received bytes stay one copy of the model per version.
  if (absl::GetFlag(FLAGS_delta)) return RunDelta(config, versions, replicas_flag > 0 ? replicas_flag : 1, json);

  auto bc = StartBenchCluster("bench-e2e", {});
  if (!bc.ok()) {
    std::fprintf(stderr, "bench/e2e: cluster: %s\n", bc.status().ToString().c_str());
    return 1;
  }
  if (!json) std::fprintf(stderr, "bench/e2e: cluster up (coordinator + 2 nodes); running...\n");
  StrategyResult wb = RunStrategy(*bc->cluster, "weightbridge", config, versions, replicas);
  StrategyResult r0;
  r0.strategy = "rank0_broadcast";
  r0.verified = true;  // not run: nothing to verify
  if (absl::GetFlag(FLAGS_baseline)) r0 = RunStrategy(*bc->cluster, "rank0_broadcast", config, versions, replicas);
  bc->harness->KillAll();
  const double tcp = TcpLoopbackGBps(int64_t{1} << 30);
  const double link_gbps = absl::GetFlag(FLAGS_link_gbps);
  const double mem = MemcpyGBps(int64_t{256} << 20);
  const double ratio = wb.median_s > 0 ? r0.median_s / wb.median_s : 0;
  const int64_t model_bytes = e2e::ModelBytes(config);

  if (json) {
    nlohmann::json j = {
        {"weightbridge_s", wb.median_s},
        {"rank0_broadcast_s", r0.median_s},
        {"bytes_weightbridge", wb.bytes_inter_node},
        {"bytes_rank0_broadcast", r0.bytes_inter_node},
        {"verified", wb.verified && r0.verified},
        {"ratio", ratio},
        {"model_bytes", model_bytes},
        {"replicas", replicas},
        {"versions", versions},
        {"weightbridge_update_s", wb.update_s},
        {"rank0_broadcast_update_s", r0.update_s},
        {"weightbridge_daemon_transfer_s", wb.daemon_transfer_s},
        {"rank0_broadcast_daemon_transfer_s", r0.daemon_transfer_s},
        {"bytes_intra_node_weightbridge", wb.bytes_intra_node},
        {"bytes_intra_node_rank0_broadcast", r0.bytes_intra_node},
        {"tcp_loopback_GBps", tcp},
        {"memcpy_GBps", mem},
        {"link_gbps", link_gbps},
    };
    // --link_gbps: the emulated NIC is the physical limit; report WeightBridge's time against it.
    if (link_gbps > 0) {
      j["link_bound_s"] = wb.bytes_inter_node / (link_gbps * 1e9 / 8);
      j["ratio_to_link_bound"] = wb.bytes_inter_node > 0 ? wb.median_s / (wb.bytes_inter_node / (link_gbps * 1e9 / 8)) : 0;
    }
    if (!wb.error.empty()) j["weightbridge_error"] = wb.error;
    if (!r0.error.empty()) j["rank0_broadcast_error"] = r0.error;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("Qwen2.5-0.5B (%s, %.3f GB bf16), 2 Megatron tp=2 trainers on n0 -> %d vLLM tp=2 "
                "replica(s) on n1, sync mode, %d versions (median of v2..)\n",
                config.c_str(), model_bytes / 1e9, replicas, versions);
    std::printf("%-16s %10s %12s %14s %14s %10s %9s\n", "strategy", "update_s", "daemon_xfer_s",
                "inter_node_GB", "intra_node_GB", "net GB/s", "verified");
    for (const StrategyResult* r : {&wb, &r0}) {
      double net = r->median_s > 0 ? r->bytes_inter_node / r->median_s / 1e9 : 0;
      std::printf("%-16s %10.3f %12.3f %14.3f %14.3f %10.2f %9s\n", r->strategy.c_str(),
                  r->median_s, r->daemon_transfer_s, r->bytes_inter_node / 1e9,
                  r->bytes_intra_node / 1e9, net, r->verified ? "yes" : "NO");
      if (!r->error.empty()) std::printf("  error: %s\n", r->error.c_str());
    }
    std::printf("ratio rank0_broadcast / weightbridge: %.2fx\n", ratio);
    std::printf("host transport limits (same run): TCP loopback %.2f GB/s (1 stream), memcpy %.2f GB/s\n",
                tcp, mem);
    if (link_gbps > 0 && wb.bytes_inter_node > 0) {
      const double bound = wb.bytes_inter_node / (link_gbps * 1e9 / 8);
      std::printf("emulated link (--link_gbps): %.1f Gb/s per node egress; WeightBridge's inter-node bytes need %.3f s on it: "
                  "update_s / that = %.2fx\n", link_gbps, bound, wb.median_s / bound);
    }
  }
  return (wb.verified && r0.verified) ? 0 : 1;
}

}  // namespace
}  // namespace wb::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return wb::bench::Run();
}

// Soak test: a stream of versions (one test async, one sync) through a real coordinator + 2 node
// daemons (processes, loopback TCP between the nodes) while faults are injected at random moments:
//   node_kill    kill -9 of node n1 (rollout side) and a restart with the same id and socket;
//   tcp_drop     every established TCP connection of n1 destroyed (`ss -K`: data plane and gRPC,
//                both ends see a reset);
//   slow_peer    n1 frozen with SIGSTOP for 0.3-1.5 s, then SIGCONT: a slow peer, not a lost one
//                (the lease is 10 s, so a loaded machine's heartbeat delays on top of the freeze
//                do not turn it into a lease loss; the test checks the coordinator lost no lease);
//   worker_exit  rollout/1 (on n0) killed -9 and a fresh process started for the same rank;
//   coord_restart kill -9 of the coordinator and a restart on the same address (the nodes re-join
//                with their workers, layouts and committed versions);
//   trainer_restart both trainer ranks killed -9 a moment apart and a new pair started at the
//                version after the newest they had touched.
// Workers are tests/e2e's trainer_worker / rollout_worker (tiny Qwen2 config, presets resolved by
// the daemons): every applied version is checked byte for byte, and after every failed version
// the rollout checks its live weights are still exactly the previous version (no partial apply).
//
// After each fault the test waits (bounded) until a newer version committed with every worker
// registered again: that fault was survived. At the end: every worker exited 0, no mismatch,
// no version left in flight, the coordinator and n0 hold no more file descriptors than before the
// run (+ a small bound for kept data channels), every daemon shuts down cleanly on SIGTERM, and no
// shared-memory segment of any worker is left in /dev/shm (except those of workers killed with
// kill -9: their owner is dead, they are counted, reported and removed - see docs/soak.md).
//
// Deterministic schedule: WB_SOAK_SEED (default printed), WB_SOAK_VERSIONS (default 200),
// WB_SOAK_FAULTS (default 12), WB_SOAK_KINDS (comma list: only these fault kinds).
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/cluster.h"
#include "tests/e2e/harness.h"
#include "tests/soak/soak_util.h"
#include "base/status_macros.h"

namespace wb::e2e {
namespace {

namespace pb = weightbridge::v1;
using nlohmann::json;

constexpr char kModel[] = "soak";
constexpr char kSs[] = "/usr/bin/ss";


int CountFds(pid_t pid) {
  DIR* d = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n;
}

// "socket:[123]" -> "socket", "anon_inode:[pidfd]" kept whole, paths kept: what the fds are.
std::string FdKinds(pid_t pid) {
  std::map<std::string, int> kinds;
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return "?";
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char buf[256];
    ssize_t n = ::readlink(absl::StrCat(dir, "/", e->d_name).c_str(), buf, sizeof(buf) - 1);
    std::string t = n > 0 ? std::string(buf, n) : "?";
    if (absl::StartsWith(t, "socket:") || absl::StartsWith(t, "pipe:")) t = t.substr(0, t.find(':'));
    ++kinds[t];
  }
  ::closedir(d);
  std::vector<std::string> out;
  for (const auto& [k, n] : kinds) out.push_back(absl::StrCat(k, " x", n));
  return absl::StrJoin(out, ", ");
}

std::set<std::string> ShmNames() {
  std::set<std::string> out;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') out.insert(e->d_name);
  }
  ::closedir(d);
  return out;
}

// The segments the soak's worker process `pid` created: the e2e workers name them
// /wb-e2e-<role>-<pid>-<n>-<salt> (tests/e2e/worker_common.cc). Called once that process exited
// (reaped): a live process holding `pid` now is another one - pids are reused, and other tests run
// beside this one (make test: two at a time) - so nothing is attributed to it, and nothing of
// another test's (say a Python client's "wb-ptr-<pid>-...") is ever counted or unlinked here.
// Segments created before `not_before` (this soak's start) are not its workers' either: an e2e
// worker of an earlier test that held the same pid before the pids wrapped (32768 on CI
// machines, a few minutes of builds) and was killed left it.
std::vector<std::string> ShmOfPid(pid_t pid, absl::Time not_before) {
  std::vector<std::string> out;
  if (::kill(pid, 0) == 0 || errno == EPERM) {
    std::printf("soak: pid %d is in use by another process again: its segments are not checked\n", static_cast<int>(pid));
    return out;
  }
  const std::string needle = absl::StrCat("-", pid, "-");
  for (const std::string& n : ShmNames()) {
    if (!absl::StartsWith(n, "wb-e2e-") || n.find(needle) == std::string::npos) continue;
    struct stat st {};
    if (::stat(absl::StrCat("/dev/shm/", n).c_str(), &st) == 0 && absl::TimeFromTimespec(st.st_ctim) < not_before) {
      std::printf("soak: /dev/shm/%s predates this run (an earlier process with pid %d): not counted\n", n.c_str(), static_cast<int>(pid));
      continue;
    }
    out.push_back(n);
  }
  return out;
}

uint64_t Committed(const pb::StatusResponse& s) {
  for (const auto& m : s.models()) {
    if (m.model_id() == kModel) return m.committed_version();
  }
  return 0;
}

bool AllRegistered(const pb::StatusResponse& s) {
  for (const auto& m : s.models()) {
    if (m.model_id() == kModel) return m.registered_trainers() == 2 && m.registered_rollouts() == 2;
  }
  return false;
}

// How often the coordinator declared `node` lost (its log: msg="node lost" node=<node>).
int NodeLostCount(const Process* coordinator, const std::string& node) {
  std::ifstream in(coordinator->log_path());
  const std::string needle = absl::StrCat("msg=\"node lost\" node=", node, " ");
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

// Runs argv to completion and returns its stdout lines. A shell prints an end marker with the
// exit code, so every line has been read when we return (the harness reaps exits and reads
// pipes on different threads).
absl::StatusOr<std::vector<std::string>> RunCaptured(Harness* h, const std::string& name,
                                                     const std::vector<std::string>& argv) {
  std::vector<std::string> sh = {"/bin/sh", "-c", "\"$@\"; echo __end__ $?", "sh"};
  sh.insert(sh.end(), argv.begin(), argv.end());
  ASSIGN_OR_RETURN(Process * p, h->Spawn(name, sh));
  ASSIGN_OR_RETURN(std::string end, p->WaitForLine([](const std::string& l) { return absl::StartsWith(l, "__end__ "); },
                                                   absl::Seconds(10)));
  if (end != "__end__ 0") return absl::InternalError(absl::StrCat(argv[0], " ", argv[1], ": ", end, " ", p->LogTail(500)));
  std::vector<std::string> lines = p->Lines();
  lines.pop_back();  // the marker (last line: nothing is printed after it)
  return lines;
}

// Destroys every established TCP socket owned by `pid` (both ends get a reset). Returns how
// many were destroyed.
absl::StatusOr<int> DropTcp(Harness* h, pid_t pid, int k) {
  ASSIGN_OR_RETURN(std::vector<std::string> list,
                   RunCaptured(h, absl::StrCat("ss-list-", k), {kSs, "-tnpH", "state", "established"}));
  const std::string owner = absl::StrCat("pid=", pid, ",");
  std::vector<std::string> filter;
  for (const std::string& line : list) {
    if (line.find(owner) == std::string::npos) continue;
    std::vector<std::string> cols = absl::StrSplit(line, ' ', absl::SkipEmpty());
    // Recv-Q Send-Q Local:Port Peer:Port Process
    if (cols.size() < 4) continue;
    const std::string& local = cols[2];
    const std::string port = local.substr(local.rfind(':') + 1);
    if (!filter.empty()) filter.push_back("or");
    filter.insert(filter.end(), {"sport", "=", ":" + port});
  }
  if (filter.empty()) return 0;
  std::vector<std::string> argv = {kSs, "-K", "-tnH", "state", "established", "("};
  argv.insert(argv.end(), filter.begin(), filter.end());
  argv.push_back(")");
  ASSIGN_OR_RETURN(std::vector<std::string> killed, RunCaptured(h, absl::StrCat("ss-kill-", k), argv));
  return static_cast<int>(killed.size());
}

// `ss -K` needs CAP_NET_ADMIN and a kernel with SOCK_DESTROY: probe it on a loopback connection
// of our own, which must come back reset.
bool CanDestroySockets(Harness* h) {
  if (::access(kSs, X_OK) != 0) return false;
  int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bool ok = false;
  if (l >= 0 && ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(l, 1) == 0 &&
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (cfd >= 0 && ::connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      int sfd = ::accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
      auto n = DropTcp(h, ::getpid(), -1);
      char b = 0;
      ok = n.ok() && *n >= 1 && ::recv(cfd, &b, 1, MSG_DONTWAIT) < 0 && errno != EAGAIN;
      if (sfd >= 0) ::close(sfd);
    }
    if (cfd >= 0) ::close(cfd);
  }
  if (l >= 0) ::close(l);
  return ok;
}

// The whole soak in `mode` (async or sync): see the top of this file.
void RunSoak(const std::string& mode) {
  const absl::Time soak_start = absl::Now();  // segments older than this are no worker's of this run
  const uint64_t seed = EnvOr("WB_SOAK_SEED", 20261202);
  const int versions = static_cast<int>(EnvOr("WB_SOAK_VERSIONS", 200));
  const int num_faults = static_cast<int>(EnvOr("WB_SOAK_FAULTS", 12));
  std::printf("soak: mode=%s seed=%llu (WB_SOAK_SEED) versions=%d faults=%d\n", mode.c_str(),
              static_cast<unsigned long long>(seed), versions, num_faults);
  std::fflush(stdout);
  const absl::Time t0 = absl::Now();
  std::mt19937_64 rng(seed);

  auto h_or = Harness::Create("soak");
  ASSERT_TRUE(h_or.ok()) << h_or.status();
  Harness* h = h_or->get();
  const bool can_drop_tcp = CanDestroySockets(h);
  if (!can_drop_tcp) std::printf("soak: `ss -K` unusable here: tcp_drop faults replaced by node_kill\n");

  ClusterOptions co;
  co.num_nodes = 2;
  co.heartbeat_ms = 200;
  // Well above the longest freeze (1.5 s): with a 3 s lease, a loaded 2-core machine's heartbeat
  // delays on top of a freeze could expire it and make slow_peer a lease loss. Killed and restarted
  // nodes do not wait for the lease: the restart's registration ends the old incarnation.
  co.lease_ms = ScaledMs(10000);
  co.transfer_timeout_ms = 8000;
  auto cluster_or = Cluster::Start(h, co);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  Cluster* c = cluster_or->get();
  const int coord_fd0 = CountFds(c->coordinator()->pid());
  const int n0_fd0 = CountFds(c->node(0)->pid());
  const std::string n0_kinds0 = FdKinds(c->node(0)->pid());

  RunOptions run;
  run.config = Runfile("tests/soak/testdata/qwen2-tiny.json");
  run.model_id = kModel;
  run.mode = mode;
  run.num_trainers = 2;
  run.num_rollouts = 2;
  run.versions = versions;
  run.timeout_ms = 10000;
  run.layout_source = "preset";
  run.tolerate_failures = true;
  std::vector<Process*> trainers, rollouts, killed;
  const WorkerSpec trainer_spec[2] = {{.trainer = true, .node = 0, .preset = "megatron", .tp = 2, .rank = 0, .step_ms = 60},
                                      {.trainer = true, .node = 0, .preset = "megatron", .tp = 2, .rank = 1, .step_ms = 60}};
  for (const WorkerSpec& w : trainer_spec) {
    auto p = c->SpawnWorker(run, w);
    ASSERT_TRUE(p.ok()) << p.status();
    trainers.push_back(*p);
  }
  const WorkerSpec rollout_spec[2] = {
      {.trainer = false, .node = 1, .preset = "vllm", .tp = 1, .replicas = 2, .rank = 0, .step_ms = 30},
      {.trainer = false, .node = 0, .preset = "vllm", .tp = 1, .replicas = 2, .rank = 1, .step_ms = 30}};
  for (const WorkerSpec& w : rollout_spec) {
    auto p = c->SpawnWorker(run, w);
    ASSERT_TRUE(p.ok()) << p.status();
    rollouts.push_back(*p);
  }
  for (Process* r : rollouts) {
    auto ev = r->WaitForEvent("verified", 0, absl::Seconds(60));
    ASSERT_TRUE(ev.ok()) << ev.status() << "\n" << r->LogTail();
  }

  // The schedule: every kind at least twice, the rest random, shuffled; fault k is injected once
  // trainer/0 reached version `milestone(k)` (spread over the first 80% of the versions, so the
  // tail completes without faults).
  std::vector<std::string> kinds = {"node_kill", "tcp_drop", "slow_peer", "worker_exit", "coord_restart", "trainer_restart"};
  if (const char* only = std::getenv("WB_SOAK_KINDS"); only != nullptr && *only != '\0') {
    kinds = absl::StrSplit(only, ',', absl::SkipEmpty());  // e.g. WB_SOAK_KINDS=tcp_drop,node_kill
  }
  std::vector<std::string> schedule;
  for (int k = 0; k < num_faults; ++k) {
    schedule.push_back(k < 2 * static_cast<int>(kinds.size()) ? kinds[k % kinds.size()] : kinds[rng() % kinds.size()]);
  }
  std::shuffle(schedule.begin(), schedule.end(), rng);
  std::map<std::string, int> injected, survived;
  int tcp_dropped_sockets = 0;
  for (int k = 0; k < num_faults; ++k) {
    const int milestone = 3 + (k + 1) * (versions * 8 / 10 - 3) / (num_faults + 1);
    auto reached = trainers[0]->WaitForLine(
        [&](const std::string& line) {
          json j = json::parse(line, nullptr, false);
          if (j.is_discarded() || !j.is_object() || !j.contains("version") || !j["version"].is_number()) {
            return false;
          }
          return j["version"].get<int>() >= milestone;
        },
        absl::Seconds(90));
    ASSERT_TRUE(reached.ok()) << "version " << milestone << " before fault " << k << ": " << reached.status()
                              << "\n" << trainers[0]->LogTail();
    auto before = c->Status();
    ASSERT_TRUE(before.ok()) << before.status();
    const uint64_t committed_before = Committed(*before);
    // Newest version trainer/0 touched before the fault: recovery = every rollout verified a newer
    // one, i.e. a version published after the fault went through the whole path.
    uint64_t newest_before = 0;
    for (const json& e : trainers[0]->Events()) newest_before = std::max(newest_before, U64(e, "version"));
    std::string kind = schedule[k];
    if (kind == "tcp_drop" && !can_drop_tcp) kind = "node_kill";
    const absl::Time fault_at = absl::Now();
    const int lost_before = NodeLostCount(c->coordinator(), "n1");
    std::string detail;
    if (kind == "node_kill") {
      ASSERT_TRUE(c->KillNode(1).ok());
      ASSERT_TRUE(c->RestartNode(1).ok()) << "restart of n1 after fault " << k;
    } else if (kind == "tcp_drop") {
      auto n = DropTcp(h, c->node(1)->pid(), k);
      ASSERT_TRUE(n.ok()) << n.status();
      tcp_dropped_sockets += *n;
      detail = absl::StrCat(*n, " sockets");
    } else if (kind == "slow_peer") {
      const absl::Duration pause = absl::Milliseconds(300 + rng() % 1200);
      c->node(1)->Signal(SIGSTOP);
      absl::SleepFor(pause);  // the fault itself: n1 frozen this long
      c->node(1)->Signal(SIGCONT);
      detail = absl::FormatDuration(pause);
    } else if (kind == "trainer_restart") {
      // Both trainer ranks killed -9 (a moment apart, mid-step or mid-publish), then a new pair
      // started at the version after the newest either had touched: what a framework restarting
      // its training job from a checkpoint does. A version the old pair published must never be
      // read from the new processes' memory (sync: the trainers' live weights are the source).
      const int first = static_cast<int>(rng() % 2);
      trainers[first]->Kill();
      absl::SleepFor(absl::Milliseconds(rng() % 200));  // the fault itself: the second rank dies later
      trainers[1 - first]->Kill();
      uint64_t touched = 0;
      for (Process* t : trainers) {
        ASSERT_TRUE(t->WaitExit(absl::Seconds(10)).ok());
        for (const json& e : t->Events()) touched = std::max(touched, U64(e, "version"));
        killed.push_back(t);
      }
      RunOptions again = run;
      again.first_version = static_cast<int>(touched) + 1;
      again.versions = versions - static_cast<int>(touched);  // (--versions counts from --first_version)
      ASSERT_GE(again.versions, 1) << "trainer_restart after the last version";
      for (int r = 0; r < 2; ++r) {
        auto p = c->SpawnWorker(again, trainer_spec[r]);
        ASSERT_TRUE(p.ok()) << p.status();
        trainers[r] = *p;
      }
      newest_before = touched;
      detail = absl::StrCat("rank ", first, " first, restart at v", touched + 1);
    } else if (kind == "coord_restart") {
      // kill -9 of the coordinator, restarted on the same address: the nodes re-join with their
      // workers, layouts and committed versions; a version in flight is aborted everywhere.
      ASSERT_TRUE(c->KillCoordinator().ok());
      ASSERT_TRUE(c->RestartCoordinator().ok()) << "restart of the coordinator after fault " << k;
    } else {  // worker_exit
      Process* old = rollouts[1];
      old->Kill();
      ASSERT_TRUE(old->WaitExit(absl::Seconds(10)).ok());
      killed.push_back(old);
      auto p = c->SpawnWorker(run, rollout_spec[1]);
      ASSERT_TRUE(p.ok()) << p.status();
      rollouts[1] = *p;
    }
    ++injected[kind];
    for (Process* r : rollouts) {
      auto got = r->WaitForLine(
          [&](const std::string& line) {
            json j = json::parse(line, nullptr, false);
            return !j.is_discarded() && j.is_object() && Str(j, "event") == "verified" &&
                   Str(j, "why") == "applied" && U64(j, "version") > newest_before;
          },
          absl::Seconds(45));
      ASSERT_TRUE(got.ok()) << "fault " << k << " (" << kind << "): " << r->name() << " never verified a version > "
                            << newest_before << ": " << got.status() << "\n" << r->LogTail(2000)
                            << "\nn1: " << c->node(1)->LogTail(2000) << "\ncoordinator: " << c->coordinator()->LogTail(2000);
    }
    auto after = c->WaitForStatus([&](const pb::StatusResponse& s) { return AllRegistered(s); }, absl::Seconds(20),
                                  absl::StrCat("every worker registered after fault ", k));
    ASSERT_TRUE(after.ok()) << after.status();
    if (kind == "slow_peer") {
      EXPECT_EQ(NodeLostCount(c->coordinator(), "n1"), lost_before)
          << "fault " << k << ": n1 frozen for " << detail << " lost its lease\ncoordinator: " << c->coordinator()->LogTail(2000);
    }
    ++survived[kind];
    std::printf("soak: fault %2d %-11s at v%-4d %-12s recovered in %6.2fs (committed v%llu -> v%llu)\n", k,
                kind.c_str(), milestone, detail.c_str(), absl::ToDoubleSeconds(absl::Now() - fault_at),
                static_cast<unsigned long long>(committed_before),
                static_cast<unsigned long long>(Committed(*after)));
    std::fflush(stdout);
  }

  // Everyone finishes: trainers after the last publish committed, rollouts after the last version.
  std::vector<Process*> workers = trainers;
  workers.insert(workers.end(), rollouts.begin(), rollouts.end());
  for (Process* w : workers) {
    auto rc = w->WaitExit(absl::Seconds(120));
    ASSERT_TRUE(rc.ok()) << w->name() << ": " << rc.status() << "\n" << w->LogTail();
    EXPECT_EQ(*rc, 0) << w->name() << " exit code\n" << w->LogTail();
  }

  // Counts. Every "verified" is a full byte check; a "mismatch" would also have made it exit 3.
  std::set<uint64_t> verified_versions;
  int verified = 0, kept_after_failure = 0, version_failed = 0, published = 0, publish_failed = 0;
  std::vector<Process*> all_rollouts = rollouts;
  all_rollouts.insert(all_rollouts.end(), killed.begin(), killed.end());
  for (Process* r : all_rollouts) {
    for (const json& e : r->Events()) {
      const std::string ev = Str(e, "event");
      EXPECT_NE(ev, "mismatch") << r->name() << ": " << e.dump();
      if (ev == "verified" && Str(e, "why") == "applied") {
        ++verified;
        verified_versions.insert(U64(e, "version"));
      }
      if (ev == "verified" && Str(e, "why") == "after_failure") ++kept_after_failure;
      if (ev == "version_failed") ++version_failed;
    }
  }
  std::vector<Process*> every_process = trainers;  // trainer/0's versions, over its restarts too
  every_process.insert(every_process.end(), killed.begin(), killed.end());
  for (Process* p : every_process) {
    for (const json& e : p->Events()) {
      if (Str(e, "worker") != "trainer/0") continue;
      if (Str(e, "event") == "published") ++published;
      if (Str(e, "event") == "publish_failed") ++publish_failed;
    }
  }
  auto final_status = c->Status();
  ASSERT_TRUE(final_status.ok()) << final_status.status();
  int committed_versions = 0, aborted_versions = 0;
  for (const auto& v : final_status->versions()) {
    if (v.model_id() != kModel) continue;
    EXPECT_TRUE(v.state() != "transferring" && v.state() != "publishing")
        << "version " << v.version() << " still " << v.state() << " after the run";
    if (v.state() == "committed" || v.state() == "applied") ++committed_versions;
    if (v.state() == "aborted") ++aborted_versions;
  }
  EXPECT_EQ(Committed(*final_status), static_cast<uint64_t>(versions)) << "the last version did not commit";
  EXPECT_TRUE(verified_versions.count(versions)) << "no rollout verified the last version";

  // The daemons notice exited workers on their next liveness tick: wait until none is left.
  auto drained = c->WaitForStatus(
      [&](const pb::StatusResponse& s) {
        for (const auto& w : s.workers()) {
          if (w.model_id() == kModel) return false;
        }
        return true;
      },
      absl::Seconds(20), "every exited worker dropped");
  EXPECT_TRUE(drained.ok()) << drained.status();

  // File descriptors of the processes that lived through every fault.
  const int coord_fd1 = CountFds(c->coordinator()->pid());
  const int n0_fd1 = CountFds(c->node(0)->pid());
  // Bound: a kept data channel per peer (a few TCP streams) and gRPC channels may outlive the run;
  // one leak per fault or per version would exceed it.
  constexpr int kFdSlack = 12;
  EXPECT_LE(coord_fd1, coord_fd0 + kFdSlack) << "coordinator fds " << coord_fd0 << " -> " << coord_fd1;
  std::string n0_sockets;
  if (n0_fd1 > n0_fd0 + kFdSlack) {
    auto ss = RunCaptured(h, "ss-n0", {kSs, "-tuxanpH"});
    const std::string owner = absl::StrCat("pid=", c->node(0)->pid(), ",");
    if (ss.ok()) {
      for (const std::string& l : *ss) {
        if (l.find(owner) != std::string::npos) absl::StrAppend(&n0_sockets, "\n  ", l);
      }
    }
  }
  EXPECT_LE(n0_fd1, n0_fd0 + kFdSlack) << "n0 fds " << n0_fd0 << " -> " << n0_fd1 << "; its TCP sockets:" << n0_sockets
                                       << "\nbefore: " << n0_kinds0 << "\nafter: " << FdKinds(c->node(0)->pid());

  // Clean shutdown of every daemon.
  for (Process* d : {c->node(0), c->node(1), c->coordinator()}) {
    d->Signal(SIGTERM);
    auto rc = d->WaitExit(absl::Seconds(15));
    ASSERT_TRUE(rc.ok()) << d->name() << ": " << rc.status();
    EXPECT_EQ(*rc, 0) << d->name() << " did not shut down cleanly\n" << d->LogTail(2000);
  }

  // Shared memory: workers that exited unlinked theirs; killed workers' segments are orphans.
  int leaked = 0, orphaned = 0;
  for (Process* w : workers) {
    for (const std::string& n : ShmOfPid(w->pid(), soak_start)) {
      ADD_FAILURE() << "shm segment /dev/shm/" << n << " of " << w->name() << " left behind";
      ++leaked;
    }
  }
  for (Process* w : killed) {
    for (const std::string& n : ShmOfPid(w->pid(), soak_start)) {
      ++orphaned;
      ::unlink(absl::StrCat("/dev/shm/", n).c_str());
    }
  }

  int faults = 0, ok = 0;
  std::vector<std::string> per_kind;
  for (const auto& [kind, n] : injected) {
    faults += n;
    ok += survived[kind];
    per_kind.push_back(absl::StrCat(kind, "=", survived[kind], "/", n));
  }
  std::printf(
      "soak: RESULT mode=%s seed=%llu faults survived %d/%d (%s; %d TCP sockets destroyed) | trainer published %d "
      "(failed %d) of %d | committed %d, aborted %d (coordinator) | rollout verifications %d "
      "(distinct versions %zu), previous version intact after %d failed applies (%d failures) | "
      "fds coordinator %d->%d n0 %d->%d | shm leaked %d, orphaned by kill -9 %d (removed) | %.1fs\n",
      mode.c_str(), static_cast<unsigned long long>(seed), ok, faults, absl::StrJoin(per_kind, " ").c_str(),
      tcp_dropped_sockets, published, publish_failed, versions, committed_versions, aborted_versions, verified,
      verified_versions.size(), kept_after_failure, version_failed, coord_fd0, coord_fd1, n0_fd0, n0_fd1, leaked,
      orphaned, absl::ToDoubleSeconds(absl::Now() - t0));
}

TEST(SoakTest, AsyncVersionsSurviveInjectedFaults) { RunSoak("async"); }

// Sync mode: every rollout pauses (BeginUpdate) and waits (WaitVersion) for each version; a failed
// wait is followed by EndUpdate and a check that the live weights are one whole version
// (tests/e2e/rollout_worker.cc). The mode whose commits write the live weights directly.
TEST(SoakTest, SyncVersionsSurviveInjectedFaults) { RunSoak("sync"); }

}  // namespace
}  // namespace wb::e2e

// Chaos with the issue-17 features on: lossless deltas, quantised rollouts and relays across
// rollout nodes, while processes are killed at random moments. Real processes on loopback
// (tests/e2e harness + cluster): a coordinator, n0 with two Megatron tp=2 trainer ranks, and three
// rollout nodes n1..n3 with one vLLM tp=1 replica each (fp8_block128: the pieces whose 128x128
// blocks the trainers' shards hold whole are quantised on n0 and travel as fp8 + scales, qkv_proj -
// whose KV rows the two trainer ranks split inside a block - is quantised on the rollout's node
// from canonical bytes in its staging's shadows). Daemons: --delta_cache_bytes=64 MiB (deltas of
// the fp8 bytes, and of the canonical bytes into the shadows), 256 KiB buckets (the planner relays
// between the rollout nodes), end-to-end digests on (the default). Weights: synthetic versions in
// which 5% of the elements change per version (tests/common/weight_gen.h), so versions really
// travel as deltas.
//
// Faults, one per milestone of trainer/0's version (spread over the first 80% of the versions;
// every kind at least once, the rest random, shuffled by the seed):
//   node_rollout  kill -9 of a rollout node (n1..n3) and a restart with the same id and socket;
//   node_trainer  kill -9 of n0 and a restart (the trainers reconnect; its delta cache is gone);
//   coordinator   kill -9 of the coordinator and a restart on the same port;
//   rollout_exit  kill -9 of one rollout process and a fresh one for the same rank (catch-up);
//   trainer_pair  kill -9 of one trainer rank, then of the other, fresh ranks from the next version.
//
// Checked: after each fault every rollout verifies (all bytes) a version newer than anything
// the trainers had touched before it (the last version if they had reached it), within 45 s;
// every rollout byte of every applied version is exact (rollout_worker checks all bytes; a
// mismatch is exit 3) and after every failed version the live weights are still exactly the
// previous version; every worker exits 0, the last version
// commits; deltas and cross-node relays were used (n0's "version transferred" lines, the rollout
// nodes' wb_bytes_total between them); every daemon exits 0 on SIGTERM. Printed: delta bytes,
// refused deltas by reason (each resent in full - never a wrong byte - but each a wasted stream).
//
// Modes: sync, one-step-off, async (one case each). WB_CHAOS_SEED (default 20261207, printed),
// WB_CHAOS_FAULTS (default 8), WB_CHAOS_VERSIONS (default 120; 60 in sync). Variants (manual runs;
// the defaults are the run described above):
//   WB_CHAOS_QUANT=fp8_block128|w4a16_g32|nvfp4|mxfp8|none  the rollouts' scheme (none: bf16);
//   WB_CHAOS_DIGESTS=0                      daemons with --digests=false;
//   WB_CHAOS_LORA=1                         LoRA-only versions (peft dp=2 trainers, vllm_lora
//                                           rollouts, all seven Qwen2 targets, r=8; no quantisation);
//   WB_CHAOS_ROLLOUT_TP=N                   each rollout node holds one engine of N ranks (default
//                                           2 with LoRA, else 1); rollout_exit kills one rank.
// docs/soak.md "Chaos with deltas, quantised rollouts and relays".
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/metrics_scrape.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/cluster.h"
#include "tests/e2e/harness.h"
#include "tests/soak/soak_util.h"

namespace wb::e2e {
namespace {

namespace pb = weightbridge::v1;
using nlohmann::json;

constexpr int kRolloutNodes = 3;


// key=value fields of a daemon log line ("..." values unquoted).
std::map<std::string, std::string> Fields(const std::string& line) {
  std::map<std::string, std::string> out;
  size_t i = 0;
  while (i < line.size()) {
    const size_t eq = line.find('=', i);
    if (eq == std::string::npos) break;
    size_t k = line.rfind(' ', eq);
    k = k == std::string::npos || k < i ? i : k + 1;
    std::string value;
    size_t end;
    if (eq + 1 < line.size() && line[eq + 1] == '"') {
      end = line.find('"', eq + 2);
      if (end == std::string::npos) end = line.size();
      value = line.substr(eq + 2, end - eq - 2);
      ++end;
    } else {
      end = line.find(' ', eq);
      if (end == std::string::npos) end = line.size();
      value = line.substr(eq + 1, end - eq - 1);
    }
    out[line.substr(k, eq - k)] = value;
    i = end;
  }
  return out;
}

// Sums of the delta fields of the "version transferred" lines in `logs`, refusals by reason.
struct DeltaTally {
  double replaced = 0, stream = 0, full = 0, fallback_bytes = 0, decoded = 0, fallbacks = 0, digest_bytes = 0;
  std::map<std::string, int> refusals;  // first refusal of a version, cut before its numbers
};
void Tally(const std::string& path, DeltaTally* t) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.find("msg=\"version transferred\"") == std::string::npos) continue;
    std::map<std::string, std::string> f = Fields(line);
    auto num = [&](const char* k) {
      double d = 0;
      return absl::SimpleAtod(f[k], &d) ? d : 0.0;
    };
    t->replaced += num("delta_replaced_bytes");
    t->stream += num("delta_bytes");
    t->full += num("delta_full_bytes");
    t->fallback_bytes += num("delta_fallback_bytes");
    t->decoded += num("delta_decoded");
    t->fallbacks += num("delta_fallbacks");
    t->digest_bytes += num("digest_bytes");
    const std::string& r = f["delta_refusal"];
    if (!r.empty()) {
      const size_t colon = r.find("): ");
      ++t->refusals[colon == std::string::npos ? r.substr(0, 60) : r.substr(colon + 3, 40)];
    }
  }
}

class ChaosDeltaTest : public testing::TestWithParam<std::string> {};

TEST_P(ChaosDeltaTest, DeltasQuantisedRolloutsAndRelaysSurviveKills) {
  const std::string mode = GetParam();
  const uint64_t seed = EnvOr("WB_CHAOS_SEED", 20261207);
  // Sync: half the versions (a sync version waits for every rollout to pause: about 3x as long
  // each), so the case stays near the others' time in CI.
  const int versions = static_cast<int>(EnvOr("WB_CHAOS_VERSIONS", mode == "sync" ? 60 : 120));
  const int num_faults = static_cast<int>(EnvOr("WB_CHAOS_FAULTS", 8));
  const bool lora = EnvOr("WB_CHAOS_LORA", 0) != 0;
  const bool digests = EnvOr("WB_CHAOS_DIGESTS", 1) != 0;
  const std::string quant = EnvStrOr("WB_CHAOS_QUANT", lora ? "none" : "fp8_block128");
  const int rollout_tp = static_cast<int>(EnvOr("WB_CHAOS_ROLLOUT_TP", lora ? 2 : 1));
  ASSERT_GE(rollout_tp, 1);
  const int rollout_procs = kRolloutNodes * rollout_tp;
  std::printf("chaos_delta: mode=%s seed=%llu (WB_CHAOS_SEED) versions=%d faults=%d quant=%s digests=%d lora=%d rollout_tp=%d\n",
              mode.c_str(), static_cast<unsigned long long>(seed), versions, num_faults, quant.c_str(), digests, lora, rollout_tp);
  std::fflush(stdout);
  const absl::Time t0 = absl::Now();
  std::mt19937_64 rng(seed);

  auto h_or = Harness::Create("chaos-delta-" + mode);
  ASSERT_TRUE(h_or.ok()) << h_or.status();
  ClusterOptions co;
  co.num_nodes = 1 + kRolloutNodes;
  co.heartbeat_ms = 200;
  co.lease_ms = ScaledMs(10000);
  co.transfer_timeout_ms = ScaledMs(8000);
  co.extra_daemon_flags = {"--delta_cache_bytes=67108864", "--bucket_bytes=262144"};
  if (!digests) co.extra_daemon_flags.push_back("--digests=false");
  co.node_metrics = true;
  auto cluster_or = Cluster::Start(h_or->get(), co);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  Cluster* c = cluster_or->get();
  std::vector<Process*> node_incarnations;
  for (int i = 0; i < co.num_nodes; ++i) node_incarnations.push_back(c->node(i));

  RunOptions run;
  run.config = Runfile("tests/soak/testdata/qwen2-tiny.json");
  run.model_id = "chaos-" + mode;
  run.mode = mode;
  run.num_trainers = 2;
  run.num_rollouts = rollout_procs;
  run.versions = versions;
  run.timeout_ms = ScaledMs(15000);
  run.layout_source = "preset";
  run.tolerate_failures = true;
  std::vector<std::string> weights = {"--delta_fraction=0.05"};
  if (lora) {
    // The model is the adapters alone (ModelSpec.lora), as in e2e_lora_test's qwen case.
    weights.insert(weights.end(), {"--lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--lora_r=8",
                                   "--lora_alpha=16"});
  }
  auto trainer_spec = [&](int r) {
    WorkerSpec w{.trainer = true, .node = 0, .preset = "megatron", .tp = 2, .rank = r, .gpu = r, .step_ms = 60};
    if (lora) w = WorkerSpec{.trainer = true, .node = 0, .preset = "peft", .tp = 1, .dp = 2, .rank = r, .gpu = r, .step_ms = 60};
    w.extra_flags = weights;
    return w;
  };
  // Rollout process r: rank r % tp of the engine on node 1 + r / tp.
  auto rollout_spec = [&](int r) {
    WorkerSpec w{.trainer = false, .node = 1 + r / rollout_tp, .preset = lora ? "vllm_lora" : "vllm", .tp = rollout_tp,
                 .replicas = kRolloutNodes, .rank = r, .gpu = r % rollout_tp, .step_ms = 30};
    w.extra_flags = weights;
    if (quant != "none") w.extra_flags.push_back("--quantization=" + quant);
    return w;
  };
  std::vector<Process*> trainers, rollouts, replaced;
  for (int r = 0; r < 2; ++r) {
    auto p = c->SpawnWorker(run, trainer_spec(r));
    ASSERT_TRUE(p.ok()) << p.status();
    trainers.push_back(*p);
  }
  for (int r = 0; r < rollout_procs; ++r) {
    auto p = c->SpawnWorker(run, rollout_spec(r));
    ASSERT_TRUE(p.ok()) << p.status();
    rollouts.push_back(*p);
  }
  for (Process* r : rollouts) {
    auto ev = r->WaitForEvent("verified", 0, Scaled(absl::Seconds(60)));
    ASSERT_TRUE(ev.ok()) << ev.status() << "\n" << r->LogTail();
  }

  const std::vector<std::string> kinds = {"node_rollout", "node_trainer", "coordinator", "rollout_exit", "trainer_pair"};
  std::vector<std::string> schedule;
  for (int k = 0; k < num_faults; ++k) {
    schedule.push_back(k < static_cast<int>(kinds.size()) ? kinds[k] : kinds[rng() % kinds.size()]);
  }
  std::shuffle(schedule.begin(), schedule.end(), rng);
  std::map<std::string, int> survived;
  double longest_recovery_s = 0;
  for (int k = 0; k < num_faults; ++k) {
    const int milestone = 3 + (k + 1) * (versions * 8 / 10 - 3) / (num_faults + 1);
    auto reached = trainers[0]->WaitForLine(
        [&](const std::string& line) {
          json j = json::parse(line, nullptr, false);
          return !j.is_discarded() && j.is_object() && U64(j, "version") >= static_cast<uint64_t>(milestone);
        },
        Scaled(absl::Seconds(90)));
    ASSERT_TRUE(reached.ok()) << "version " << milestone << " before fault " << k << ": " << reached.status() << "\n"
                              << trainers[0]->LogTail();
    // A random moment inside the version's transfer.
    absl::SleepFor(absl::Milliseconds(rng() % 80));
    uint64_t newest_before = 0;
    for (Process* t : trainers) {
      for (const json& e : t->Events()) newest_before = std::max(newest_before, U64(e, "version"));
    }
    if (newest_before >= static_cast<uint64_t>(versions)) {
      // A loaded machine let the trainers finish before this milestone was seen: what is left is
      // not a fault during training (a rollout that joins once every trainer has gone).
      std::printf("chaos_delta: faults %d-%d skipped: the trainers reached the last version first\n", k, num_faults - 1);
      break;
    }
    const std::string& kind = schedule[k];
    std::string detail;
    const absl::Time fault_at = absl::Now();
    if (kind == "node_rollout" || kind == "node_trainer") {
      const int i = kind == "node_trainer" ? 0 : 1 + static_cast<int>(rng() % kRolloutNodes);
      ASSERT_TRUE(c->KillNode(i).ok());
      ASSERT_TRUE(c->RestartNode(i).ok()) << "restart of n" << i << " after fault " << k;
      node_incarnations.push_back(c->node(i));
      detail = absl::StrCat("n", i);
    } else if (kind == "coordinator") {
      ASSERT_TRUE(c->KillCoordinator().ok());
      ASSERT_TRUE(c->RestartCoordinator().ok()) << "restart of the coordinator after fault " << k;
    } else if (kind == "rollout_exit") {
      const int r = static_cast<int>(rng() % rollout_procs);
      rollouts[r]->Kill();
      ASSERT_TRUE(rollouts[r]->WaitExit(absl::Seconds(10)).ok());
      replaced.push_back(rollouts[r]);
      auto p = c->SpawnWorker(run, rollout_spec(r));
      ASSERT_TRUE(p.ok()) << p.status();
      rollouts[r] = *p;
      detail = absl::StrCat("rollout/", r);
    } else {  // trainer_pair: one rank dies mid-publish; its peer cannot publish alone
      const int r = static_cast<int>(rng() % 2);
      trainers[r]->Kill();
      absl::SleepFor(absl::Milliseconds(rng() % 300));
      trainers[1 - r]->Kill();
      uint64_t next = 0;
      for (Process* t : trainers) {
        ASSERT_TRUE(t->WaitExit(absl::Seconds(10)).ok());
        for (const json& e : t->Events()) next = std::max(next, U64(e, "version"));
        replaced.push_back(t);
      }
      ++next;
      RunOptions again = run;
      again.first_version = static_cast<int>(next);
      again.versions = versions - static_cast<int>(next) + 1;
      for (int q = 0; q < 2; ++q) {
        auto p = c->SpawnWorker(again, trainer_spec(q));
        ASSERT_TRUE(p.ok()) << p.status();
        trainers[q] = *p;
      }
      detail = absl::StrCat("rank ", r, " first, again from v", next);
    }
    // The trainers may reach the last version while the fault is handled: then the last version
    // is what every rollout must verify.
    const uint64_t target = std::min<uint64_t>(newest_before + 1, static_cast<uint64_t>(versions));
    for (Process* r : rollouts) {
      auto got = r->WaitForLine(
          [&](const std::string& line) {
            json j = json::parse(line, nullptr, false);
            return !j.is_discarded() && j.is_object() && Str(j, "event") == "verified" && Str(j, "why") == "applied" &&
                   U64(j, "version") >= target;
          },
          Scaled(absl::Seconds(45)));
      ASSERT_TRUE(got.ok()) << "fault " << k << " (" << kind << " " << detail << "): " << r->name()
                            << " never verified version " << target << " or newer: " << got.status() << "\n"
                            << r->LogTail(2000) << "\ncoordinator: " << c->coordinator()->LogTail(2000);
    }
    ++survived[kind];
    const double recovery_s = absl::ToDoubleSeconds(absl::Now() - fault_at);
    longest_recovery_s = std::max(longest_recovery_s, recovery_s);
    std::printf("chaos_delta: fault %2d %-12s %-28s after v%-4llu recovered in %6.2fs\n", k, kind.c_str(), detail.c_str(),
                static_cast<unsigned long long>(newest_before), recovery_s);
    std::fflush(stdout);
  }

  // Everyone finishes: rollouts after the last version, trainers after their last publish.
  std::vector<Process*> workers = trainers;
  workers.insert(workers.end(), rollouts.begin(), rollouts.end());
  for (Process* w : workers) {
    auto rc = w->WaitExit(Scaled(absl::Seconds(120)));
    ASSERT_TRUE(rc.ok()) << w->name() << ": " << rc.status() << "\n" << w->LogTail();
    EXPECT_EQ(*rc, 0) << w->name() << " exit code\n" << w->LogTail();
  }
  int verified = 0, kept_after_failure = 0, version_failed = 0;
  bool last_verified = false;
  std::vector<Process*> all = workers;
  all.insert(all.end(), replaced.begin(), replaced.end());
  for (Process* p : all) {
    for (const json& e : p->Events()) {
      const std::string ev = Str(e, "event");
      EXPECT_NE(ev, "mismatch") << p->name() << ": " << e.dump();
      if (ev == "verified" && Str(e, "why") == "applied") {
        ++verified;
        last_verified = last_verified || U64(e, "version") == static_cast<uint64_t>(versions);
      }
      if (ev == "verified" && Str(e, "why") == "after_failure") ++kept_after_failure;
      if (ev == "version_failed") ++version_failed;
    }
  }
  EXPECT_TRUE(last_verified) << "no rollout verified the last version";
  auto st = c->Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(VersionState(*st, run.model_id, versions), "committed") << st->DebugString();
  // Version outcomes as the coordinator (its last incarnation) knows them.
  std::map<std::string, int> states;
  for (int v = 1; v <= versions; ++v) {
    const std::string s = VersionState(*st, run.model_id, static_cast<uint64_t>(v));
    ++states[s.empty() ? "unknown" : s];
  }

  // The features were in play: deltas from n0, relays between the rollout nodes (the current
  // incarnations' counters: the last 20% of the versions run without faults).
  DeltaTally n0, receivers;
  for (Process* n : node_incarnations) Tally(n->log_path(), n->name().rfind("n0-", 0) == 0 ? &n0 : &receivers);
  EXPECT_GT(n0.replaced, 0) << "no op travelled as a delta";
  EXPECT_LT(n0.stream, 0.5 * n0.replaced) << "delta streams are not smaller than the bytes they replaced";
  double relayed = 0;
  for (int a = 1; a <= kRolloutNodes; ++a) {
    auto m = daemon::ScrapeMetrics(c->node_metrics_port(a), absl::Seconds(10));
    ASSERT_TRUE(m.ok()) << m.status();
    for (int b = 1; b <= kRolloutNodes; ++b) {
      if (a != b) relayed += daemon::MetricSum(*m, "wb_bytes_total", absl::StrCat("node=\"n", a, "\",peer=\"n", b, "\""));
    }
  }
  EXPECT_GT(relayed, 0) << "the rollout nodes relayed nothing to each other";
  // Digests as configured: every node hashed bytes, or none did.
  if (digests) {
    EXPECT_GT(n0.digest_bytes + receivers.digest_bytes, 0) << "no node computed an end-to-end digest";
  } else {
    EXPECT_EQ(n0.digest_bytes + receivers.digest_bytes, 0) << "--digests=false, yet a node hashed bytes";
  }

  for (int i = 0; i < co.num_nodes; ++i) c->node(i)->Signal(SIGTERM);
  c->coordinator()->Signal(SIGTERM);
  std::vector<Process*> daemons = {c->coordinator()};
  for (int i = 0; i < co.num_nodes; ++i) daemons.push_back(c->node(i));
  for (Process* d : daemons) {
    auto rc = d->WaitExit(absl::Seconds(15));
    ASSERT_TRUE(rc.ok()) << d->name() << ": " << rc.status();
    EXPECT_EQ(*rc, 0) << d->name() << " did not shut down cleanly\n" << d->LogTail(2000);
  }
  std::vector<std::string> refusals;
  for (const auto& [why, n] : receivers.refusals) refusals.push_back(absl::StrCat(n, "x '", why, "'"));
  std::vector<std::string> per_kind;
  for (const auto& [kind, n] : survived) per_kind.push_back(absl::StrCat(kind, "=", n));
  std::vector<std::string> per_state;
  for (const auto& [state, n] : states) per_state.push_back(absl::StrCat(state, "=", n));
  std::printf(
      "chaos_delta: RESULT mode=%s seed=%llu quant=%s digests=%d lora=%d rollout_tp=%d faults survived %s, longest recovery "
      "%.2fs | versions at the coordinator: %s | rollout verifications %d, previous version intact after "
      "%d failed versions (%d) | n0 deltas: %.1f MB replaced by %.1f MB of streams, %.1f MB full | receivers: %.0f decoded, "
      "%.0f refused (%.2f MB resent in full; first reason per version: %s) | relayed between rollout nodes %.1f MB | %.1fs\n",
      mode.c_str(), static_cast<unsigned long long>(seed), quant.c_str(), digests, lora, rollout_tp, absl::StrJoin(per_kind, " ").c_str(),
      longest_recovery_s, absl::StrJoin(per_state, " ").c_str(), verified, kept_after_failure,
      version_failed, n0.replaced / 1e6, n0.stream / 1e6, n0.full / 1e6, receivers.decoded, receivers.fallbacks,
      receivers.fallback_bytes / 1e6, refusals.empty() ? "none" : absl::StrJoin(refusals, ", ").c_str(), relayed / 1e6,
      absl::ToDoubleSeconds(absl::Now() - t0));
}

INSTANTIATE_TEST_SUITE_P(Modes, ChaosDeltaTest, testing::Values("sync", "one_step_off", "async"),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace wb::e2e

#include "daemon/node/delta_node.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "base/clock.h"
#include "base/shm_segment.h"
#include "daemon/delta/codec.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/metrics.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"

namespace wb::daemon::node {
namespace {

TEST(ResolveDeltaThreads, AnExplicitCountIsKept) {
  EXPECT_EQ(ResolveDeltaThreads(1, 64), 1);
  EXPECT_EQ(ResolveDeltaThreads(5, 2), 5);
  EXPECT_EQ(ResolveDeltaThreads(40, 8), 40);
}

TEST(ResolveDeltaThreads, AutoIsHalfTheCpusBetweenTwoAndSixteen) {
  EXPECT_EQ(ResolveDeltaThreads(0, 0), 2);  // hardware_concurrency() may not know
  EXPECT_EQ(ResolveDeltaThreads(0, 2), 2);  // this VM: as before
  EXPECT_EQ(ResolveDeltaThreads(0, 5), 2);
  EXPECT_EQ(ResolveDeltaThreads(0, 16), 8);  // the device machine
  EXPECT_EQ(ResolveDeltaThreads(0, 32), 16);
  EXPECT_EQ(ResolveDeltaThreads(0, 224), 16);
}

// After a commit the background applier waits --delta_apply_delay_ms on the node's clock before it
// applies the sent streams to the cached copies (not while other nodes still commit); an encode
// that comes first applies its key itself; a model that goes ends the wait at once.
TEST(NodeDeltasTest, TheBackgroundApplyWaitsTheDelayOnTheClock) {
  FakeClock clock;
  LocalWorkers::Options lo;
  lo.node_id = "n0";
  lo.clock = &clock;
  LocalWorkers local(lo);
  constexpr size_t kN = 1 << 16;
  UninitVector<uint8_t> v1(kN), v2(kN);
  for (size_t i = 0; i < kN; ++i) v1[i] = static_cast<uint8_t>(i * 7);
  std::memcpy(v2.data(), v1.data(), kN);
  for (size_t i = 0; i < kN; i += 50) v2[i] ^= 1;
  const delta::Digest d1 = delta::DigestOf(absl::MakeConstSpan(v1.data(), kN), 2);
  delta::Digest d2;
  delta::EncodeOptions eo;
  eo.elem_size = 2;
  eo.base_digest = d1;
  std::vector<uint8_t> out(delta::MaxEncodedBytes(kN, 2));
  auto n = delta::EncodeInto({1, absl::MakeConstSpan(v1.data(), kN)}, {2, absl::MakeConstSpan(v2.data(), kN)}, eo,
                             absl::MakeSpan(out), nullptr, &d2);
  ASSERT_TRUE(n.ok()) << n.status();
  out.resize(*n);
  const DeltaKey key = DeltaKey::Of(0, planner::Box{{0}, {static_cast<int64_t>(kN / 2)}}, 2);
  for (bool encode_first : {false, true}) {
    NodeDeltas deltas(64 << 20, 2, &clock, absl::Milliseconds(200));
    DeltaOptions o = deltas.For("n0", "m", pb::PlanSlice(), {}, local);
    ASSERT_NE(o.cache, nullptr);
    UninitVector<uint8_t> first(kN);
    std::memcpy(first.data(), v1.data(), kN);
    ASSERT_TRUE(o.cache->AddPending(key, 1, std::move(first), d1, /*packs=*/false));
    o.cache->Commit(1);
    ASSERT_TRUE(o.cache->AddPendingStream(key, 2, 1, out, d2));
    const absl::Time committed = clock.Now();
    deltas.Commit("m", 2);
    // The applier waits on the clock, exactly the delay from the commit, with nothing applied.
    ASSERT_TRUE(clock.AwaitWaiter(committed + absl::Milliseconds(200), absl::Now() + absl::Seconds(30)));
    EXPECT_EQ(o.cache->stats().applied_streams, 0u) << "nothing applied before the delay passed on the clock";
    EXPECT_EQ(o.cache->stats().queued_streams, 1u);
    if (encode_first) {
      auto e = o.cache->Committed(key, 2);  // the next encode: applies the key itself
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(std::memcmp(e->bytes.data(), v2.data(), kN), 0);
      EXPECT_EQ(o.cache->stats().applied_streams, 1u);
      // The model goes while the applier still waits: the wait ends at once (else this hangs).
    } else {
      clock.Advance(absl::Milliseconds(200));
      auto e = o.cache->Committed(key, 2);  // applied by the background thread or here: version 2
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(std::memcmp(e->bytes.data(), v2.data(), kN), 0);
      EXPECT_EQ(o.cache->stats().applied_streams, 1u);
    }
  }
}

// A one-step-off / async rollout that applies its committed version while the next version runs
// (chaos run, fp8_block128 rollouts: about one version in fifteen): when the version started the
// rollout had not applied yet, so its incoming staging was not the base (no in-place decode) and
// the base is its committed staging; Apply then copied that into live weights and let it go. The
// base must stay that staging - live weights hold the same version but end where the staging's
// canonical shadows of receiver-quantised pieces begin, so deltas into the shadows were refused
// ("the committed copy has N bytes, the box reaches byte M") and resent in full.
TEST(NodeDeltasTest, AnApplyWhileTheVersionRunsLeavesTheCommittedStagingTheBase) {
  FakeClock clock;
  transport::TransportConfig tc;
  std::unique_ptr<transport::Transport> t = transport::NewHostShmTransport(tc);
  ASSERT_NE(t, nullptr);
  LiveCopier copier("n0", t.get(), [](const std::string&) { return absl::OkStatus(); });
  LocalWorkers::Options lo;
  lo.node_id = "n0";
  lo.clock = &clock;
  lo.copier = &copier;
  lo.live_copy_timeout = absl::Seconds(30);
  LocalWorkers local(lo);
  // Live weights: one 16 KiB buffer (the quantised pieces); staging: the same plus 16 KiB of
  // canonical shadows behind it (planner::StagingLayout).
  constexpr int64_t kLive = 16384;
  const LocalWorkers::WorkerKey key{"m", "rollout/0"};
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kRollout;
  w.mode = pb::MODE_ONE_STEP_OFF;
  local.Add(key, std::move(w), std::nullopt);
  auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("dn"), kLive);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::vector<std::shared_ptr<transport::ShmSegment>> live = {std::make_shared<transport::ShmSegment>(std::move(*seg))};
  ASSERT_TRUE(local.AttachLayout(key, live, {nullptr}, pb::SubmitLayoutRequest(), pb::ResolvedLayout()).ok());
  auto staging = std::make_shared<StagedBytes>(1);
  (*staging)[0].host.assign(2 * kLive, 0xAB);
  const uint8_t* staged = (*staging)[0].host.data();
  EXPECT_TRUE(local.Commit("m", 1, {{"rollout/0", staging}}, {}).empty()) << "one-step-off: Apply copies";

  pb::PlanSlice slice;
  pb::PlanWorker* pw = slice.add_workers();
  pw->set_worker_id("rollout/0");
  pw->set_node_id("n0");
  pw->set_role(pb::ROLE_ROLLOUT);
  NodeDeltas deltas(0, 2, &clock);
  // Version 2 starts: the rollout holds version 1 committed, not applied.
  DeltaOptions o = deltas.For("n0", "m", slice, {{"rollout/0", 1}}, local);
  std::optional<DeltaBase> before = o.base("w0.b0");
  ASSERT_TRUE(before.has_value());
  EXPECT_EQ(before->version, 1u);
  EXPECT_EQ(before->data, staged);
  EXPECT_EQ(before->size, 2 * kLive);
  EXPECT_EQ(before->what, "the committed staging");  // named in a refusal (DecodeOp)

  // Apply of version 1 while version 2 runs: the live copy, then the staging is let go.
  std::vector<LocalWorkers::LiveJob> jobs(1);
  jobs[0].model = "m";
  jobs[0].worker = "rollout/0";
  jobs[0].version = 1;
  jobs[0].staging = staging;
  jobs[0].live = LiveBuffers{live, {nullptr}};
  planner::WorkerLayout layout;
  layout.buffers = {{kLive}};
  jobs[0].layout = layout;
  jobs[0].inventory = std::make_shared<planner::Inventory>();
  jobs[0].label = "apply rollout/0 v1";
  std::vector<absl::Status> copied = local.RunLiveCopies(jobs);
  ASSERT_TRUE(copied[0].ok()) << copied[0];
  local.MarkApplied(key, 1, staging, /*after_commit=*/false);
  ASSERT_EQ(local.Get(key)->worker.committed, nullptr) << "Apply let the staging go";
  ASSERT_EQ(local.Get(key)->worker.applied_version, 1u);
  jobs.clear();
  staging.reset();

  // Version 2's decodes: still version 1's staging, shadows included, alive while the options are.
  std::optional<DeltaBase> after = o.base("w0.b0");
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->version, 1u);
  EXPECT_EQ(after->size, 2 * kLive) << "the base lost the canonical shadows (live weights instead of the committed staging)";
  EXPECT_EQ(after->data, staged);
  EXPECT_EQ(after->what, "the committed staging held at the start");
  ASSERT_NE(after->hold, nullptr);
  EXPECT_EQ(after->data[2 * kLive - 1], 0xAB);

  // The next version starts after the apply: live weights are the base (as before).
  DeltaOptions next = deltas.For("n0", "m", slice, {{"rollout/0", 1}}, local);
  std::optional<DeltaBase> b3 = next.base("w0.b0");
  ASSERT_TRUE(b3.has_value());
  EXPECT_EQ(b3->size, kLive);
  // Named in a refusal with what the rollout held: live weights lack the shadows.
  EXPECT_TRUE(absl::StartsWith(b3->what, "the live weights; committed v1 applied v1 now; at the start committed v1 applied v1, no committed staging"))
      << b3->what;
  EXPECT_EQ(b3->data, static_cast<const uint8_t*>(live[0]->data()));
}

// The race behind NVFP4 deltas refused in one-step-off / async chaos runs (docs/soak.md "NVFP4
// deltas"): the rollout applied version 1 (its committed staging left the worker's entry) just
// before version 2 chose its staging, while something still held that staging (the Apply until
// it reported to the coordinator, before 6117dfa; a running version's options; any holder between
// the entry letting go and the last reference), so the tagged buffer was not back in the pool.
// Before the fix the tag missed, no staging was named and the base was the live weights, which lack the
// canonical shadows: every delta into a shadow refused and resent in full. Now the staging choice
// (NodeStaging::TakeBase, as Versions::AllocateStaging calls it) finds the staging still held and
// it is the base; once the Apply lets go, the buffer itself comes back for an in-place decode.
TEST(NodeDeltasTest, AnApplyStillHoldingItsStagingAtTheNextVersionsChoiceLeavesItTheBase) {
  FakeClock clock;
  transport::TransportConfig tc;
  std::unique_ptr<transport::Transport> t = transport::NewHostShmTransport(tc);
  ASSERT_NE(t, nullptr);
  LiveCopier copier("n0", t.get(), [](const std::string&) { return absl::OkStatus(); });
  DaemonMetrics metrics;
  NodeStaging::Options so;
  so.node_id = "n0";
  so.clock = &clock;
  so.metrics = &metrics;
  so.copier = &copier;
  NodeStaging staging_pool(so);
  LocalWorkers::Options lo;
  lo.node_id = "n0";
  lo.clock = &clock;
  lo.copier = &copier;
  lo.live_copy_timeout = absl::Seconds(30);
  LocalWorkers local(lo);
  constexpr int64_t kLive = 16384;  // live: the quantised pieces; staging: those + the shadows
  const LocalWorkers::WorkerKey key{"m", "rollout/0"};
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kRollout;
  w.mode = pb::MODE_ASYNC;
  local.Add(key, std::move(w), std::nullopt);
  auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("dn"), kLive);
  ASSERT_TRUE(seg.ok()) << seg.status();
  std::vector<std::shared_ptr<transport::ShmSegment>> live = {std::make_shared<transport::ShmSegment>(std::move(*seg))};
  ASSERT_TRUE(local.AttachLayout(key, live, {nullptr}, pb::SubmitLayoutRequest(), pb::ResolvedLayout()).ok());
  // Version 1's incoming staging from the pool, committed and tagged (Versions::CommitVersion).
  std::shared_ptr<StagedBytes> staging = staging_pool.NewBytes(1);
  (*staging)[0].host = staging_pool.TakeHost(2 * kLive);
  std::memset((*staging)[0].host.data(), 0xAB, 2 * kLive);
  const uint8_t* staged = (*staging)[0].host.data();
  EXPECT_TRUE(local.Commit("m", 1, {{"rollout/0", staging}}, {}).empty());
  const std::string tag = NodeStaging::BaseTag("m", "rollout/0", 0, 1);
  (*staging)[0].pool_tag = tag;
  staging_pool.Lend(staging);

  // Apply of version 1: the live copy, then the entry lets the staging go - but the Apply's job
  // still holds it (as WorkerCalls::CopyApplicable did until its report to the coordinator).
  std::vector<LocalWorkers::LiveJob> jobs(1);
  jobs[0].model = "m";
  jobs[0].worker = "rollout/0";
  jobs[0].version = 1;
  jobs[0].staging = staging;
  jobs[0].live = LiveBuffers{live, {nullptr}};
  planner::WorkerLayout layout;
  layout.buffers = {{kLive}};
  jobs[0].layout = layout;
  jobs[0].inventory = std::make_shared<planner::Inventory>();
  jobs[0].label = "apply rollout/0 v1";
  ASSERT_TRUE(local.RunLiveCopies(jobs)[0].ok());
  local.MarkApplied(key, 1, staging, /*after_commit=*/false);
  staging.reset();
  ASSERT_EQ(local.Get(key)->worker.committed, nullptr);
  ASSERT_EQ(local.Get(key)->worker.applied_version, 1u);

  // Version 2 chooses its staging now: held = the applied version 1.
  const absl::Time deadline = clock.Now() + absl::Seconds(10);
  NodeStaging::Base b = staging_pool.TakeBase(2 * kLive, tag, deadline);
  EXPECT_FALSE(b.matched) << "the buffer is not back yet";
  ASSERT_NE(b.held, nullptr) << "the staging still held by the Apply was not found";
  EXPECT_EQ((*b.held)[0].host.data(), staged);
  pb::PlanSlice slice;
  pb::PlanWorker* pw = slice.add_workers();
  pw->set_worker_id("rollout/0");
  pw->set_node_id("n0");
  pw->set_role(pb::ROLE_ROLLOUT);
  NodeDeltas deltas(0, 2, &clock);
  DeltaOptions o = deltas.For("n0", "m", slice, {{"rollout/0", 1}}, local, {}, {}, {}, {{"rollout/0", {1, b.held}}});
  b.held.reset();
  jobs.clear();  // the Apply returns: only version 2's options hold the staging now
  std::optional<DeltaBase> base = o.base("w0.b0");
  ASSERT_TRUE(base.has_value());
  EXPECT_EQ(base->version, 1u);
  EXPECT_EQ(base->size, 2 * kLive) << "the base lost the canonical shadows: " << base->what;
  EXPECT_EQ(base->data, staged);
  EXPECT_EQ(base->data[2 * kLive - 1], 0xAB);

  // Version 3, after version 2's options are gone: the buffer is back, taken by its tag.
  o = DeltaOptions();
  base.reset();
  NodeStaging::Base again = staging_pool.TakeBase(2 * kLive, tag, deadline);
  EXPECT_TRUE(again.matched);
  EXPECT_EQ(again.host.data(), staged);
  EXPECT_EQ(again.held, nullptr);
}

}  // namespace
}  // namespace wb::daemon::node

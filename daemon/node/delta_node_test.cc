#include "daemon/node/delta_node.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "base/clock.h"
#include "daemon/delta/codec.h"
#include "daemon/node/local_workers.h"

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

}  // namespace
}  // namespace wb::daemon::node

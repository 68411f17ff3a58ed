#include "base/default_init_allocator.h"

#include <sys/resource.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace wb {
namespace {

// Values are kept where given; copies and growth keep the bytes that were there.
TEST(DefaultInitAllocatorTest, BehavesAsAVectorOtherwise) {
  UninitVector<uint8_t> v(3, 7);
  EXPECT_EQ(v[0], 7);
  v.push_back(9);
  v.resize(8);
  EXPECT_EQ(v[3], 9);
  UninitVector<uint8_t> w = v;
  EXPECT_EQ(w[1], 7);
  UninitVector<std::string> s(2);  // class types are still default-constructed
  EXPECT_TRUE(s[1].empty());
}

long MaxRssKb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// A 1 GiB buffer of which one page is written takes about one page of memory, not 1 GiB (a
// zeroing std::vector would touch every page: >= 1 GiB of peak RSS).
TEST(DefaultInitAllocatorTest, LargeBuffersAreNotTouchedUpFront) {
  // Sanitizers map and fill shadow memory for allocations: RSS says nothing about the pages there.
  if (std::getenv("WB_SANITIZER") != nullptr) GTEST_SKIP() << "RSS is not meaningful under " << std::getenv("WB_SANITIZER");
  const long before = MaxRssKb();
  UninitVector<uint8_t> v(size_t{1} << 30);
  v[12345] = 1;
  EXPECT_EQ(v[12345], 1);
  EXPECT_LT(MaxRssKb() - before, 256 * 1024) << "the allocation touched most of its pages";
}

}  // namespace
}  // namespace wb

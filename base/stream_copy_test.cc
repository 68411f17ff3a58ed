#include "base/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace wb {
namespace {

// Every length around the thresholds and the 64-byte loop, every destination and source
// alignment: the bytes are memcpy's, nothing before or after the destination is touched.
TEST(StreamCopy, CopiesExactlyAtEveryAlignmentAndLength) {
  std::vector<uint8_t> src(3 * kStreamCopyMin + 200);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, kStreamCopyMin - 1, kStreamCopyMin, kStreamCopyMin + 1,
                   kStreamCopyMin + 63, 2 * kStreamCopyMin + 17, 3 * kStreamCopyMin}) {
    for (size_t d_off : {0, 1, 7, 15, 16, 33}) {
      for (size_t s_off : {0, 3, 16}) {
        std::vector<uint8_t> dst(n + 64, 0xEE);
        StreamCopy(dst.data() + d_off, src.data() + s_off, n);
        StreamFence();
        for (size_t i = 0; i < d_off; ++i) ASSERT_EQ(dst[i], 0xEE) << "before, n " << n << " d " << d_off;
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(dst[d_off + i], src[s_off + i]) << "n " << n << " d " << d_off << " s " << s_off << " i " << i;
        for (size_t i = d_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "after, n " << n << " d " << d_off;
      }
    }
  }
}

}  // namespace
}  // namespace wb

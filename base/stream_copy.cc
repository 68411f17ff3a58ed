#include "base/stream_copy.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wb {

void StreamCopy(void* dst_v, const void* src_v, size_t n) {
  uint8_t* dst = static_cast<uint8_t*>(dst_v);
  const uint8_t* src = static_cast<const uint8_t*>(src_v);
#if defined(__x86_64__)
  if (n >= kStreamCopyMin) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;  // < n
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace wb

// Writes the fuzz_delta_decode seed corpus: delta::Encode outputs against the harness's base pattern
// (tests/fuzz/delta_base_pattern.h), for element sizes 1, 2, 4, 8 and five
// targets each (unchanged, few changes, many, random-looking, small dense changes over 197 elements),
// 64-element chunks, base version 1, target version 2. Run when the stream format changes:
//   bazel run //tests/fuzz:delta_seed_gen -- "$PWD/tests/fuzz/corpus/fuzz_delta_decode"
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "daemon/delta/codec.h"
#include "tests/fuzz/delta_base_pattern.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: delta_seed_gen <corpus dir>\n");
    return 2;
  }
  int seed = 0;
  for (int es : {1, 2, 4, 8}) {
    for (int variant = 0; variant < 5; ++variant) {
      const size_t elems = variant == 4 ? 197 : 192;
      const std::vector<uint8_t> base = wb::fuzz::DeltaBasePattern(elems * es);
      std::vector<uint8_t> target = base;
      uint32_t x = 12345u + static_cast<uint32_t>(es * 10 + variant);
      for (size_t i = 0; i < elems; ++i) {
        x = x * 1664525u + 1013904223u;
        uint8_t* e = target.data() + i * es;
        switch (variant) {
          case 0: break;                                      // unchanged
          case 1: if (i % 50 == 3) e[0] ^= 1; break;          // few
          case 2: if (i % 3 != 0) e[0] += 1; break;           // many, small
          case 3: for (int k = 0; k < es; ++k) e[k] = static_cast<uint8_t>(x >> (8 * (k % 4))); break;  // random-looking
          default: e[0] += static_cast<uint8_t>(1 + (x >> 29)); break;  // small dense changes
        }
      }
      wb::delta::EncodeOptions o;
      o.elem_size = es;
      o.chunk_elems = 64;
      absl::StatusOr<std::vector<uint8_t>> s = wb::delta::Encode({1, base}, {2, target}, o);
      if (!s.ok()) {
        std::fprintf(stderr, "encode: %s\n", s.status().ToString().c_str());
        return 1;
      }
      const std::string path = std::string(argv[1]) + "/seed-" + std::to_string(seed++);
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(s->data(), 1, s->size(), f) != s->size() || std::fclose(f) != 0) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        return 1;
      }
    }
  }
  std::printf("wrote %d seeds to %s\n", seed, argv[1]);
  return 0;
}

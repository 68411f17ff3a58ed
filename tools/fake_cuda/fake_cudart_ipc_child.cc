// TEST ONLY: the other process of fake_cudart_test's IPC tests.
//   open <handle hex> <size> <seed>: opens the handle twice (same pointer), checks the bytes are
//       the pattern of <seed>, writes the pattern of <seed>+1, closes twice; prints "OK" or why not.
//   hold <size> [<seed>]: allocates <size> device bytes (filled with the pattern of <seed> if given),
//       prints "READY <handle hex>", then waits for EOF on stdin (or to be killed: the shm reaper).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

uint8_t Pat(uint64_t seed, size_t i) { return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff); }

int Open(const char* hex, size_t size, uint64_t seed) {
  cudaIpcMemHandle_t h;
  if (strlen(hex) != 2 * sizeof(h)) return printf("bad handle length\n"), 1;
  for (size_t i = 0; i < sizeof(h); ++i) {
    unsigned v = 0;
    sscanf(hex + 2 * i, "%2x", &v);
    h.reserved[i] = static_cast<char>(v);
  }
  void* p = nullptr;
  void* q = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) return printf("open: %s\n", cudaGetErrorName(e)), 1;
  e = cudaIpcOpenMemHandle(&q, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess || q != p) return printf("second open: %s, %p vs %p\n", cudaGetErrorName(e), q, p), 1;
  std::vector<uint8_t> buf(size);
  if ((e = cudaMemcpy(buf.data(), p, size, cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return printf("read: %s\n", cudaGetErrorName(e)), 1;
  }
  for (size_t i = 0; i < size; ++i) {
    if (buf[i] != Pat(seed, i)) return printf("byte %zu differs\n", i), 1;
  }
  for (size_t i = 0; i < size; ++i) buf[i] = Pat(seed + 1, i);
  if ((e = cudaMemcpy(p, buf.data(), size, cudaMemcpyHostToDevice)) != cudaSuccess) {
    return printf("write: %s\n", cudaGetErrorName(e)), 1;
  }
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) return printf("sync: %s\n", cudaGetErrorName(e)), 1;
  if ((e = cudaIpcCloseMemHandle(p)) != cudaSuccess || (e = cudaIpcCloseMemHandle(p)) != cudaSuccess) {
    return printf("close: %s\n", cudaGetErrorName(e)), 1;
  }
  if (cudaIpcCloseMemHandle(p) == cudaSuccess) return printf("third close succeeded\n"), 1;
  (void)cudaGetLastError();
  printf("OK\n");
  return 0;
}

int Hold(size_t size, int64_t seed) {
  void* p = nullptr;
  cudaIpcMemHandle_t h;
  if (cudaMalloc(&p, size) != cudaSuccess || cudaIpcGetMemHandle(&h, p) != cudaSuccess) {
    return printf("alloc failed\n"), 1;
  }
  if (seed >= 0) {
    std::vector<uint8_t> buf(size);
    for (size_t i = 0; i < size; ++i) buf[i] = Pat(seed, i);
    if (cudaMemcpy(p, buf.data(), size, cudaMemcpyHostToDevice) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      return printf("fill failed\n"), 1;
    }
  }
  std::string hex;
  for (size_t i = 0; i < sizeof(h); ++i) {
    char b[3];
    snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(h.reserved[i]));
    hex += b;
  }
  printf("READY %s\n", hex.c_str());
  fflush(stdout);
  char line[16];
  while (fgets(line, sizeof(line), stdin) != nullptr) {
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 5 && strcmp(argv[1], "open") == 0) return Open(argv[2], strtoull(argv[3], nullptr, 10), strtoull(argv[4], nullptr, 10));
  if ((argc == 3 || argc == 4) && strcmp(argv[1], "hold") == 0) {
    return Hold(strtoull(argv[2], nullptr, 10), argc == 4 ? strtoll(argv[3], nullptr, 10) : -1);
  }
  fprintf(stderr, "usage: fake_cudart_ipc_child open <hex> <size> <seed> | hold <size> [<seed>]\n");
  return 2;
}

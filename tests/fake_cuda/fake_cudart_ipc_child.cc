// TEST ONLY: the other process of fake_cudart_test's IPC tests.
//   open <handle hex> <size> <seed>: opens the handle twice (same pointer), checks the bytes are
//       the pattern of <seed>, writes the pattern of <seed>+1, closes twice; prints "OK" or why not.
//   vmm_open <size> <seed>: imports the VMM allocation exported as its descriptor 3 (see VmmOpen).
//   hold <size> [<seed>]: allocates <size> device bytes (filled with the pattern of <seed> if given),
//       prints "READY <handle hex>", then waits for EOF on stdin (or to be killed: the shm reaper).
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

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

template <typename Fn>
Fn Driver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

// Imports the exported allocation at descriptor 3, maps <size> bytes, checks the pattern of <seed>
// (seed < 0: only import), writes the pattern of <seed>+1, unmaps and releases.
int VmmOpen(size_t size, int64_t seed) {
  auto import_fd = Driver<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle");
  auto reserve = Driver<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  auto map = Driver<decltype(&cuMemMap)>("cuMemMap");
  auto set_access = Driver<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  auto props = Driver<decltype(&cuMemGetAllocationPropertiesFromHandle)>("cuMemGetAllocationPropertiesFromHandle");
  auto unmap = Driver<decltype(&cuMemUnmap)>("cuMemUnmap");
  auto release = Driver<decltype(&cuMemRelease)>("cuMemRelease");
  auto free_va = Driver<decltype(&cuMemAddressFree)>("cuMemAddressFree");
  if (!import_fd || !reserve || !map || !set_access || !props || !unmap || !release || !free_va) {
    return printf("entry points missing\n"), 1;
  }
  CUmemGenericAllocationHandle h = 0;
  CUresult r = import_fd(&h, reinterpret_cast<void*>(static_cast<intptr_t>(3)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) return printf("import: %d\n", static_cast<int>(r)), 1;
  close(3);  // the imported handle keeps the memory
  if (seed < 0) return printf("imported\n"), 0;
  CUmemAllocationProp prop = {};
  if ((r = props(&prop, h)) != CUDA_SUCCESS) return printf("props: %d\n", static_cast<int>(r)), 1;
  CUdeviceptr va = 0;
  if ((r = reserve(&va, size, 0, 0, 0)) != CUDA_SUCCESS) return printf("reserve: %d\n", static_cast<int>(r)), 1;
  if ((r = map(va, size, 0, h, 0)) != CUDA_SUCCESS) return printf("map: %d\n", static_cast<int>(r)), 1;
  CUmemAccessDesc rw = {};
  rw.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  rw.location.id = prop.location.id;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = set_access(va, size, &rw, 1)) != CUDA_SUCCESS) return printf("access: %d\n", static_cast<int>(r)), 1;
  if (cudaSetDevice(prop.location.id) != cudaSuccess) return printf("set device\n"), 1;
  void* p = reinterpret_cast<void*>(va);
  std::vector<uint8_t> buf(size);
  cudaError_t e;
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
  if (unmap(va, size) != CUDA_SUCCESS || release(h) != CUDA_SUCCESS || free_va(va, size) != CUDA_SUCCESS) {
    return printf("teardown failed\n"), 1;
  }
  printf("OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 5 && strcmp(argv[1], "open") == 0) return Open(argv[2], strtoull(argv[3], nullptr, 10), strtoull(argv[4], nullptr, 10));
  if (argc == 4 && strcmp(argv[1], "vmm_open") == 0) return VmmOpen(strtoull(argv[2], nullptr, 10), strtoll(argv[3], nullptr, 10));
  if ((argc == 3 || argc == 4) && strcmp(argv[1], "hold") == 0) {
    return Hold(strtoull(argv[2], nullptr, 10), argc == 4 ? strtoll(argv[3], nullptr, 10) : -1);
  }
  fprintf(stderr, "usage: fake_cudart_ipc_child open <hex> <size> <seed> | hold <size> [<seed>]\n");
  return 2;
}

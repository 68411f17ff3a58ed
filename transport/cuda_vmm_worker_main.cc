// TEST ONLY: a worker process that shares CUDA VMM memory the way a PyTorch worker with
// expandable segments would (linked with the fake CUDA runtime in CI).
//   cuda_vmm_worker <min_bytes> <seed> <device>
// allocates an exportable cuMemCreate allocation (VmmAllocation) on <device>, fills it with
// PatternByte(<seed>, i), exports it as a POSIX fd and sends that fd over its descriptor 3 (a Unix
// SOCK_SEQPACKET socket; message "<allocation bytes>"), prints "READY <allocation bytes>", then
// answers commands on stdin until EOF:
//   CHECK <offset> <length> <seed>: "OK" when bytes [offset, offset+length) of the allocation are
//                                   PatternByte(seed, 0..length), else "BAD <first differing index>".
//   OFFER <path> <model> <worker> <key>: offers a new export of the allocation on the daemon's fd
//                                   channel at <path> (transport/fd_passing.h); prints "OK" or the error.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/cuda_vmm.h"
#include "transport/fd_passing.h"
#include "transport/test_buffer.h"

int main(int argc, char** argv) {
  using namespace wb::transport;  // NOLINT
  if (argc != 4) {
    fprintf(stderr, "usage: cuda_vmm_worker <min_bytes> <seed> <device>\n");
    return 2;
  }
  const int64_t want = strtoll(argv[1], nullptr, 10);
  const uint64_t seed = strtoull(argv[2], nullptr, 10);
  const int device = atoi(argv[3]);
  auto a = VmmAllocation::Create(device, want);
  if (!a.ok()) return printf("ERROR %s\n", std::string(a.status().message()).c_str()), 1;
  const int64_t n = (*a)->size();
  std::vector<uint8_t> bytes(n);
  for (int64_t i = 0; i < n; ++i) bytes[i] = PatternByte(seed, i);
  if (cudaMemcpy((*a)->data(), bytes.data(), n, cudaMemcpyHostToDevice) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    return printf("ERROR fill\n"), 1;
  }
  auto fd = (*a)->ExportFd();
  if (!fd.ok()) return printf("ERROR %s\n", std::string(fd.status().message()).c_str()), 1;
  absl::Status sent = SendWithFds(3, absl::StrCat(n), {*fd}, absl::Now() + absl::Seconds(30));
  if (!sent.ok()) return printf("ERROR %s\n", std::string(sent.message()).c_str()), 1;
  printf("READY %lld\n", static_cast<long long>(n));
  fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "CHECK") {
      int64_t off = 0, len = 0;
      uint64_t s = 0;
      in >> off >> len >> s;
      std::vector<uint8_t> got(len);
      if (off < 0 || len < 0 || off + len > n ||
          cudaMemcpy(got.data(), static_cast<char*>((*a)->data()) + off, len, cudaMemcpyDeviceToHost) != cudaSuccess) {
        printf("ERROR read\n");
      } else {
        int64_t bad = -1;
        for (int64_t i = 0; i < len && bad < 0; ++i) {
          if (got[i] != PatternByte(s, i)) bad = i;
        }
        if (bad < 0) {
          printf("OK\n");
        } else {
          printf("BAD %lld\n", static_cast<long long>(bad));
        }
      }
    } else if (cmd == "OFFER") {
      VmmFdOffer o;
      std::string path;
      in >> path >> o.model_id >> o.worker_id >> o.key;
      o.allocation_bytes = n;
      auto f = (*a)->ExportFd();
      absl::Status s = f.ok() ? OfferVmmFd(path, o, *f, absl::Now() + absl::Seconds(10)) : f.status();
      if (f.ok()) close(*f);
      printf("%s\n", s.ok() ? "OK" : s.ToString().c_str());
    } else {
      printf("ERROR unknown command\n");
    }
    fflush(stdout);
  }
  return 0;
}

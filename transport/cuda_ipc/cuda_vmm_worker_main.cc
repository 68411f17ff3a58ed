// TEST ONLY: a worker process that shares CUDA VMM memory the way a PyTorch worker with
// expandable segments would (linked with the fake CUDA runtime in CI).
//   cuda_vmm_worker <min_bytes> <seed> <device> [<allocations>]
// allocates an exportable cuMemCreate allocation (VmmAllocation) on <device> - or <allocations>
// of them mapped back to back in one reserved range, as an expandable segment - fills the range
// with PatternByte(<seed>, i), exports each allocation as a POSIX fd and sends those fds, in range
// order, over its descriptor 3 (a Unix SOCK_SEQPACKET socket; one message "<range bytes>"), prints
// "READY <range bytes>", then answers commands on stdin until EOF:
//   CHECK <offset> <length> <seed>: "OK" when bytes [offset, offset+length) of the range are
//                                   PatternByte(seed, 0..length), else "BAD <first differing index>".
//   CHECKROWS <offset> <pitch> <width> <rows> <seed>: "OK" when row r (bytes [offset + r * pitch,
//                                   + width)) is PatternByte(seed, r * width + 0..width) for every r.
//   OFFER <path> <model> <worker> <key>: offers a new export of the (first) allocation on the
//                                   daemon's fd channel at <path> (base/fd_passing.h); prints
//                                   "OK" or the error.
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
#include "transport/cuda_ipc/cuda_vmm.h"
#include "base/fd_passing.h"
#include "transport/testing/test_buffer.h"

int main(int argc, char** argv) {
  using namespace wb::transport;  // NOLINT
  if (argc != 4 && argc != 5) {
    fprintf(stderr, "usage: cuda_vmm_worker <min_bytes> <seed> <device> [<allocations>]\n");
    return 2;
  }
  const int64_t want = strtoll(argv[1], nullptr, 10);
  const uint64_t seed = strtoull(argv[2], nullptr, 10);
  const int device = atoi(argv[3]);
  const int count = argc == 5 ? atoi(argv[4]) : 1;
  auto a = VmmAllocation::Create(device, want, count);
  if (!a.ok()) return printf("ERROR %s\n", std::string(a.status().message()).c_str()), 1;
  const int64_t n = (*a)->size();
  std::vector<uint8_t> bytes(n);
  for (int64_t i = 0; i < n; ++i) bytes[i] = PatternByte(seed, i);
  if (cudaMemcpy((*a)->data(), bytes.data(), n, cudaMemcpyHostToDevice) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    return printf("ERROR fill\n"), 1;
  }
  std::vector<int> fds;
  for (int i = 0; i < (*a)->allocations(); ++i) {
    auto fd = (*a)->ExportFd(i);
    if (!fd.ok()) return printf("ERROR %s\n", std::string(fd.status().message()).c_str()), 1;
    fds.push_back(*fd);
  }
  absl::Status sent = SendWithFds(3, absl::StrCat(n), fds, absl::Now() + absl::Seconds(30));
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
    } else if (cmd == "CHECKROWS") {
      // Row r of a strided box: bytes [offset + r * pitch, + width) are PatternByte(seed, r * width + j).
      int64_t off = 0, pitch = 0, width = 0, rows = 0;
      uint64_t s = 0;
      in >> off >> pitch >> width >> rows >> s;
      std::string answer = "OK";
      std::vector<uint8_t> got(width > 0 ? width : 0);
      for (int64_t r = 0; r < rows && answer == "OK"; ++r) {
        const int64_t at = off + r * pitch;
        if (off < 0 || width < 0 || at + width > n ||
            cudaMemcpy(got.data(), static_cast<char*>((*a)->data()) + at, width, cudaMemcpyDeviceToHost) != cudaSuccess) {
          answer = "ERROR read";
          break;
        }
        for (int64_t j = 0; j < width; ++j) {
          if (got[j] != PatternByte(s, r * width + j)) {
            answer = absl::StrCat("BAD row ", r, " byte ", j);
            break;
          }
        }
      }
      printf("%s\n", answer.c_str());
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

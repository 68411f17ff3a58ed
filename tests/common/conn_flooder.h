#pragma once
// TEST ONLY: a flood of idle TCP connections from another process (issue 15 item 6; daemon
// flood_test, tests/probe issue15_scale_test).

#include <sys/types.h>

#include <cstdint>

namespace wb {

// A forked child opens `sources` x `per_source` idle connections to 127.0.0.1:`port` from the
// source addresses 127.0.0.2, 127.0.0.3, ... (one per "host"; never sending a byte), waits 500 ms
// for the handshakes (the kernel's backlog, not the daemon), reports how many it opened, and holds
// them until Stop (or until the parent dies). Only raw syscalls in the child: it is forked from a
// threaded process. The child raises its own fd soft limit to its hard limit.
class ConnFlooder {
 public:
  ConnFlooder() = default;
  ConnFlooder(const ConnFlooder&) = delete;
  ConnFlooder& operator=(const ConnFlooder&) = delete;
  ~ConnFlooder() { Stop(); }

  void Start(int port, int sources, int per_source);
  // Blocks until the child has tried every connection: how many it opened (-1: no answer).
  int32_t WaitReady();
  // Closes every flood connection (the child exits) and reaps the child.
  void Stop();

 private:
  pid_t pid_ = -1;
  int ready_r_ = -1, stop_w_ = -1;
};

}  // namespace wb

#pragma once
// TEST ONLY. An in-process fake of the data-plane interface (transport/transport.h), for unit tests
// of code that drives a Transport (the node's executor, channel caches, benchmarks of the control
// plane) without sockets, shared memory or child processes. It passes the same conformance suite as
// every real transport (//transport/testing:fake_transport_conformance_test, peers in-process).
//
// Model: a FakeFabric is a network of FakeTransports in one process. Every transport is two-sided
// (like host_tcp / nccl): both peers Connect to each other and post mirror batches with the same
// tag; the fabric matches the two halves, checks they agree (shape, element size, offsets, strides,
// regions) and copies the bytes on its own thread, at `link_bytes_per_second` when set (so a test
// can hold a transfer in flight). Regions are host memory only; descriptors name the exporting
// instance and region, so importing one never grants more than that region.
//
// Faults a test can inject (what unit tests of the executor need):
//   Vanish(instance)          the process behind `instance` is gone: its batches and every batch
//                             of a peer connected to it fail UNAVAILABLE naming it, within the
//                             waiters' deadlines; copies in flight stop at the next chunk.
//   FailNextBatches(i, s, n)  the next n batches posted by instance i fail with status s (after
//                             matching; nothing is written).
//   FakeOptions::corrupt      checksummed batches this transport sends arrive with one byte flipped:
//                             both sides see DATA_LOSS (like TransportConfig::test_corrupt_...).
//
// Thread-safe, like every Transport. A FakeTransport must be destroyed before its fabric.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace wb::transport::testing {

class FakeFabric {
 public:
  FakeFabric();
  ~FakeFabric();
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;

  // A process-wide fabric for tests that need only one.
  static FakeFabric* Default();

  void Vanish(absl::string_view instance);
  void FailNextBatches(absl::string_view instance, absl::Status status, int count = 1);
  // Number of transports alive on this fabric (tests check nothing leaks).
  int live_transports() const;

  class Impl;
  Impl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

struct FakeOptions {
  FakeFabric* fabric = nullptr;  // null = FakeFabric::Default()
  std::string node_id = "fake-node";
  // 0 = copy as fast as memcpy; else the simulated link speed of every batch this transport copies.
  int64_t link_bytes_per_second = 0;
  bool corrupt = false;
  std::string kind = "fake";  // Capabilities::kind (a test may pose as another kind's name)
};

std::unique_ptr<Transport> MakeFakeTransport(const FakeOptions& options = {});

}  // namespace wb::transport::testing

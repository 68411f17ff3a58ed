#pragma once
// Options of every transport implementation (read by transport/factory.h and the implementations).

#include <cstdint>
#include <string>
#include <vector>

namespace wb::transport {

struct HostShmOptions {
  int threads = 4;                          // copy thread pool size
  int64_t split_bytes = int64_t{4} << 20;   // contiguous runs longer than this are split across threads
};

struct TcpOptions {
  std::string bind_address = "127.0.0.1";  // data-channel listen address (port chosen by the kernel)
  std::string advertise_address;           // address peers dial; empty = bind_address
  // Multi-NIC striping (docs/transport.md, "host_tcp: multi-NIC and NUMA"). Empty = single-address
  // mode: one listener on bind_address, advertised as advertise_address, dialing sockets unbound
  // (the kernel picks the source). Non-empty: IPv4 addresses or interface names (resolved with
  // getifaddrs) of this node's data NICs; bind_address and advertise_address are then unused
  // (advertise_address must be empty). One listener per NIC, every NIC advertised in the endpoint;
  // data stream j of a peer (j = 0..streams-1) binds its socket to local NIC j mod L before
  // connecting to remote NIC j mod R (the control connection: NIC 0 to NIC 0), so with equal
  // NIC counts NIC k only talks to the peer's NIC k (rail-aligned). streams must be >= L.
  std::vector<std::string> local_addresses;
  int streams = 4;                         // parallel TCP connections per peer
  int64_t chunk_bytes = int64_t{1} << 20;  // max payload per frame
  // Shared secret both ends prove they hold (HMAC-SHA256 challenge-response, transport/
  // channel_auth.h) on every connection before any frame flows; the daemon passes its
  // --auth_token_file token. Empty is a valid (empty) key: two transports without a token still
  // connect, but one with a token refuses one without (UNAUTHENTICATED). Authenticates peers only:
  // the payload is neither encrypted nor MACed (docs/security.md, "Data channel").
  std::string auth_token;
  // Egress cap over all peers, streams and NICs of this transport, in bytes per second; 0 = none
  // (transport/host_tcp/send_pacer.h: the weight transfer's share of a NIC the trainer's own
  // collectives use; also how bench/e2e emulates a NIC of a given speed on loopback). Negative or
  // non-finite: INVALID_ARGUMENT.
  double max_send_bytes_per_s = 0;
};

struct CudaIpcOptions {
  int streams = 2;  // dedicated copy streams per device
};

struct NcclOptions {
  int device = 0;  // CUDA device the communicators of ONE nccl transport live on (CreateTransport)
  // CreateTransports: one nccl transport per listed device, each a "lane" of its own (every GPU
  // sends and receives on its own communicators, so NCCL drives the NIC nearest to that GPU);
  // empty = one per visible GPU. Listed devices must be visible.
  std::vector<int> devices;
};

struct TransportConfig {
  std::vector<std::string> kinds;  // empty = every usable kind
  // Identity of this node; descriptors from another node are rejected by same-node transports.
  // Empty = derived from the kernel boot id (shared by every process/container of one machine).
  std::string node_id;
  HostShmOptions host_shm;
  TcpOptions tcp;
  CudaIpcOptions cuda_ipc;
  NcclOptions nccl;
  // CPUs the data plane's threads run on (host_tcp stream/accept threads, host_shm copy threads),
  // e.g. the CPUs of the NUMA node the data NICs sit on; empty = threads float. Every CPU must be
  // one this process may run on (transport/cpu_affinity.h ValidateCpuSet), else INVALID_ARGUMENT.
  std::vector<int> cpus;
  // TEST ONLY: flip one payload byte of every checksummed batch after the sender's checksum is
  // taken, so tests can prove mismatches are detected. Never set in production.
  bool test_corrupt_checksummed_payload = false;
};

}  // namespace wb::transport

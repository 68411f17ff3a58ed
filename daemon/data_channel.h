#pragma once
// Cross-node data plane used by the executor: framed, checksummed byte streams between node
// daemons. Each frame carries one plan op's packed box, so the receiver always knows which op (and
// therefore which destination piece and box) its bytes belong to.
//
// Contract:
//  - Start() binds `listen` (host:port, port 0 = pick one) and returns the address peers dial.
//    Incoming frames are handed to `handler` on a receiver thread (one per connection); a handler
//    error closes that connection (the sender sees a failed Send).
//  - Send() is thread-safe, keeps one connection per peer (several concurrent sends to one peer
//    serialize), and fails (never hangs) once `deadline` passes or the peer is gone.
//  - Stop() closes the listener and every connection and joins the threads. Idempotent.
// Implementations are picked by main.cc (or a test); daemon logic depends only on this interface.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace wb::daemon {

struct FrameHeader {
  std::string model_id;
  uint64_t version = 0;
  uint64_t plan_epoch = 0;
  uint32_t op_index = 0;
  bool checksum_ok = true;  // false: the payload failed its checksum (handler must fail the op)
};

class DataChannel {
 public:
  using Handler = std::function<absl::Status(const FrameHeader&, absl::Span<const uint8_t>)>;
  virtual ~DataChannel() = default;
  virtual absl::StatusOr<std::string> Start(const std::string& listen, Handler handler) = 0;
  virtual absl::Status Send(const std::string& peer, const FrameHeader& header,
                            absl::Span<const uint8_t> payload, absl::Time deadline) = 0;
  // Drops the cached connection to `peer` (after an error, or when the peer restarted).
  virtual void Forget(const std::string& peer) = 0;
  virtual void Stop() = 0;
};

// TCP with an xxh3-64 checksum per frame, verified before the handler sees the bytes (a mismatch
// is DATA_LOSS and closes the connection).
std::unique_ptr<DataChannel> NewTcpDataChannel();

}  // namespace wb::daemon

#pragma once
// TEST ONLY. The command interpreter of a conformance peer (protocol in transport/testing/peer_process.h):
// one Transport, one TestBuffer registered with it, and the test's imported buffer. Run by the
// transport_peer process (stdin/stdout) and by InProcessPeer (a thread), so both speak the same
// protocol with the same code.

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "transport/testing/test_buffer.h"
#include "transport/transport.h"

namespace wb::transport {

class PeerInterpreter {
 public:
  // Registers `buffer` with `transport`. The buffer outlives the transport (destroyed after it): a
  // batch posted but never waited for may still run on the transport until it is destroyed.
  static absl::StatusOr<std::unique_ptr<PeerInterpreter>> Create(std::unique_ptr<TestBuffer> buffer,
                                                                 std::unique_ptr<Transport> transport);
  ~PeerInterpreter();

  // Executes one command line and returns the reply line ("OK ..." or "ERR <code> <message>", no
  // newline). Sets *quit on QUIT (the reply is then empty and must not be sent).
  std::string Execute(const std::string& line, bool* quit);

  Transport& transport() { return *transport_; }

 private:
  PeerInterpreter() = default;
  // CONNECT_RESULT: waits up to `timeout` for the background Connect; its reply line.
  std::string AsyncResult(absl::Duration timeout);

  std::unique_ptr<TestBuffer> buffer_;      // declared first: destroyed last
  std::unique_ptr<Transport> transport_;
  RegionHandle region_;                      // the buffer's registration
  RegionHandle test_region_;                 // the test's buffer, once imported
  PeerId peer_ = kNoPeer;

  // CONNECT_ASYNC: one Connect at a time in the background (an attempt whose caller gives up on it).
  std::thread async_;
  std::string async_round_;
  absl::Mutex async_mu_;
  std::optional<absl::StatusOr<PeerId>> async_result_ ABSL_GUARDED_BY(async_mu_);
};

// "ERR <code> <message>" with newlines flattened.
std::string ErrLine(const absl::Status& s);

}  // namespace wb::transport

#pragma once
// TEST ONLY. A conformance peer that runs in a thread of the test process instead of a child
// process, for in-process transports (transport/testing/fake_transport.h) whose peers must share
// the process. Same protocol and interpreter as transport_peer (peer_process.h).

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "transport/testing/peer_process.h"
#include "transport/testing/peer_interpreter.h"

namespace wb::transport {

class InProcessPeer final : public PeerHandle {
 public:
  // `vanish` is what Kill9 does first so that the peer disappears abruptly, as a killed process
  // would (for the fake transport: FakeFabric::Vanish of its instance); then its thread stops and
  // the interpreter (transport, buffer) is destroyed.
  InProcessPeer(std::unique_ptr<PeerInterpreter> interpreter, std::function<void(Transport&)> vanish);
  ~InProcessPeer() override;

  absl::StatusOr<std::string> Command(const std::string& line, absl::Duration timeout = absl::Seconds(60)) override;
  absl::Status Send(const std::string& line) override;
  absl::StatusOr<std::string> Reply(absl::Duration timeout = absl::Seconds(60)) override;
  void Kill9() override;

 private:
  void Run();
  void Stop();

  std::function<void(Transport&)> vanish_;
  std::unique_ptr<PeerInterpreter> interpreter_;  // used by the thread only, until Stop() joins it
  absl::Mutex mu_;
  std::deque<std::string> in_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> out_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace wb::transport

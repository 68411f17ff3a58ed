#include "transport/testing/in_process_peer.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace wb::transport {

InProcessPeer::InProcessPeer(std::unique_ptr<PeerInterpreter> interpreter, std::function<void(Transport&)> vanish)
    : vanish_(std::move(vanish)), interpreter_(std::move(interpreter)), thread_([this] { Run(); }) {}

InProcessPeer::~InProcessPeer() { Stop(); }

void InProcessPeer::Run() {
  for (;;) {
    std::string line;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](InProcessPeer* p) ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->stop_ || !p->in_.empty(); }, this));
      if (stop_) return;
      line = std::move(in_.front());
      in_.pop_front();
    }
    bool quit = false;
    std::string reply = interpreter_->Execute(line, &quit);
    absl::MutexLock l(&mu_);
    if (quit) {
      stop_ = true;
      return;
    }
    out_.push_back(std::move(reply));
  }
}

void InProcessPeer::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    gone_ = true;
  }
  if (thread_.joinable()) thread_.join();
  interpreter_.reset();
}

void InProcessPeer::Kill9() {
  bool already;
  {
    absl::MutexLock l(&mu_);
    already = gone_;
  }
  if (already) return;
  // Vanish first: a command the thread is blocked in (WAIT, CONNECT) then fails at once.
  if (vanish_ && interpreter_ != nullptr) vanish_(interpreter_->transport());
  Stop();
}

absl::Status InProcessPeer::Send(const std::string& line) {
  absl::MutexLock l(&mu_);
  if (gone_ || stop_) return absl::UnavailableError("in-process peer is gone");
  in_.push_back(line);
  return absl::OkStatus();
}

absl::StatusOr<std::string> InProcessPeer::Reply(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  const bool ready = mu_.AwaitWithTimeout(
      absl::Condition(+[](InProcessPeer* p) ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->gone_ || p->stop_ || !p->out_.empty(); }, this),
      timeout);
  if (!out_.empty()) {
    std::string line = std::move(out_.front());
    out_.pop_front();
    return ParseReplyLine(line);
  }
  if (!ready) return absl::DeadlineExceededError("in-process peer did not answer in time");
  return absl::UnavailableError("in-process peer is gone");
}

absl::StatusOr<std::string> InProcessPeer::Command(const std::string& line, absl::Duration timeout) {
  if (auto s = Send(line); !s.ok()) return s;
  return Reply(timeout);
}

}  // namespace wb::transport

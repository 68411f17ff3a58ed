#pragma once
// Process harness for end-to-end tests: real child processes (daemons, workers) in a private temp
// directory, with their stdout lines captured for progress events, logs kept on disk, and every
// child killed and reaped when the harness goes away.
//
// Contract:
//  - Spawn() forks and execs argv[0] with argv. The child's stdout is captured line by line (and
//    copied to <dir>/<name>.log); stderr goes to <dir>/<name>.log too. Children get
//    PR_SET_PDEATHSIG=SIGKILL, so they die with the harness's thread that spawned them even if
//    the test crashes; call Spawn from the test's main thread.
//  - Nothing blocks without a deadline: WaitExit, WaitForLine and WaitForPortFile all take one and
//    return DEADLINE_EXCEEDED naming what they waited for. No sleep-polling: exits are observed by
//    a reaper thread blocked in waitpid, lines by a reader thread blocked in read, files by inotify.
//  - ~Harness SIGKILLs every child still running, reaps it and joins the threads, and unlinks
//    every shm segment a child announced in a progress line ({"shm": NAME}), since a killed
//    worker cannot. The temp dir is removed unless the environment sets WB_E2E_KEEP=1 (then its
//    path is printed).
//  - Thread-safe.

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace wb::e2e {

// Sanitizer builds (--config=asan / tsan) run 5-30x slower. The e2e tests then move a smaller
// model and stretch every time limit and timeout they set by this factor (1 in normal builds), so
// the same assertions hold: bounds are scaled, never dropped.
#if defined(__SANITIZE_THREAD__)
inline constexpr int kTimeScale = 4;
#elif defined(__SANITIZE_ADDRESS__)
inline constexpr int kTimeScale = 2;
#else
inline constexpr int kTimeScale = 1;
#endif
inline absl::Duration Scaled(absl::Duration d) { return d * kTimeScale; }
inline int64_t ScaledMs(int64_t ms) { return ms * kTimeScale; }


// Path of a binary in this test's runfiles (e.g. "daemon/weightbridged"); falls back to the path
// relative to the current directory when not running under Bazel.
std::string Runfile(const std::string& workspace_relative_path);

class Process {
 public:
  ~Process();
  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // Sends `sig` (no-op once the process exited).
  void Signal(int sig);
  void Kill() { Signal(9); }
  bool Exited() const;
  // Exit status once exited and every stdout line read (Lines() / Events() are then complete):
  // the exit code, or -signal when killed by a signal. A process whose stdout stays open after
  // its exit (held by a process it started) is DEADLINE_EXCEEDED at `timeout`.
  absl::StatusOr<int> WaitExit(absl::Duration timeout) const;

  // Waits until some stdout line (from the first one on) satisfies `pred`; returns it.
  absl::StatusOr<std::string> WaitForLine(const std::function<bool(const std::string&)>& pred,
                                          absl::Duration timeout) const;
  // Waits for the JSON progress line whose "event" is `event` and, when version > 0, whose
  // "version" equals it. Fails early (FAILED_PRECONDITION with the log tail) if the process exits.
  absl::StatusOr<nlohmann::json> WaitForEvent(const std::string& event, uint64_t version,
                                              absl::Duration timeout) const;
  // All stdout lines so far / those that parse as JSON objects.
  std::vector<std::string> Lines() const;
  std::vector<nlohmann::json> Events() const;
  // Last `bytes` of the log file (for failure messages).
  std::string LogTail(size_t bytes = 4000) const;

 private:
  friend class Harness;
  Process() = default;
  void ReaderLoop(int fd);
  void ReaperLoop();

  std::string name_;
  std::string log_path_;
  pid_t pid_ = -1;
  mutable absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  bool stdout_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;
  int exit_status_ ABSL_GUARDED_BY(mu_) = 0;
  int log_fd_ = -1;
  std::thread reader_;
  std::thread reaper_;
};

class Harness {
 public:
  // Creates a fresh temp dir under /tmp (short: Unix socket paths are limited to 107 bytes).
  static absl::StatusOr<std::unique_ptr<Harness>> Create(const std::string& tag);
  ~Harness();

  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Starts `argv` (argv[0] = binary path) as child `name`; extra environment entries "K=V".
  absl::StatusOr<Process*> Spawn(const std::string& name, const std::vector<std::string>& argv,
                                 const std::vector<std::string>& env = {});
  // Waits for a port file written by a child; returns the port (the file holds a decimal port,
  // optionally followed by whitespace). Fails early if `owner` (may be null) exits first.
  absl::StatusOr<int> WaitForPortFile(const std::string& path, absl::Duration timeout,
                                      const Process* owner = nullptr);
  // Creates an empty file (test gates for workers).
  absl::Status Touch(const std::string& path);
  // SIGKILLs and reaps every child still running.
  void KillAll();

 private:
  explicit Harness(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Process>> procs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::e2e

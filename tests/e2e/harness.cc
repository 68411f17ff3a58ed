#include "tests/e2e/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "tests/e2e/file_wait.h"

namespace wb::e2e {

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    std::string p = absl::StrCat(srcdir, "/", workspace ? workspace : "weightbridge", "/", path);
    if (::access(p.c_str(), F_OK) == 0) return p;
  }
  const char* runfiles = std::getenv("RUNFILES_DIR");
  if (runfiles != nullptr) {
    std::string p = absl::StrCat(runfiles, "/weightbridge/", path);
    if (::access(p.c_str(), F_OK) == 0) return p;
  }
  // `bazel run` of a binary: runfiles next to argv[0] are not known here; fall back to bazel-bin.
  std::string bin = absl::StrCat("bazel-bin/", path);
  if (::access(bin.c_str(), F_OK) == 0) return bin;
  return path;
}

// ---------------------------------------------------------------------------------- Process

Process::~Process() {
  Signal(SIGKILL);
  if (reaper_.joinable()) reaper_.join();
  if (reader_.joinable()) reader_.join();
  if (log_fd_ >= 0) ::close(log_fd_);
}

void Process::Signal(int sig) {
  absl::MutexLock l(&mu_);
  // The reaper reaps the pid only while holding mu_ and setting exited_: the pid is still ours.
  if (!exited_ && pid_ > 0) ::kill(pid_, sig);
}

bool Process::Exited() const {
  absl::MutexLock l(&mu_);
  return exited_;
}

absl::StatusOr<int> Process::WaitExit(absl::Duration timeout) const {
  absl::MutexLock l(&mu_);
  // Exited AND its stdout read to the end: the reaper sees the exit independently of the reader,
  // which on a loaded machine may still hold the last lines (a rollout's final "applied") when
  // the caller goes on to inspect Lines() / Events().
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return exited_ && stdout_closed_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    if (exited_) {
      return absl::DeadlineExceededError(absl::StrCat(
          name_, " (pid ", pid_, ") exited with status ", exit_status_, " but its stdout was still open after ",
          absl::FormatDuration(timeout), " (a process it started holds it?)"));
    }
    return absl::DeadlineExceededError(
        absl::StrCat(name_, " (pid ", pid_, ") still running after ", absl::FormatDuration(timeout)));
  }
  return exit_status_;
}

void Process::ReaperLoop() {
  // Wait WITHOUT reaping first, so the pid cannot be reused while Signal() may still target it;
  // reap only after exited_ is set under the lock.
  siginfo_t info;
  std::memset(&info, 0, sizeof(info));
  while (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT) < 0 && errno == EINTR) {
  }
  int code = info.si_code == CLD_EXITED ? info.si_status : -info.si_status;
  absl::MutexLock l(&mu_);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  exited_ = true;
  exit_status_ = code;
}

void Process::ReaderLoop(int fd) {
  std::string partial;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (log_fd_ >= 0) {
      ssize_t off = 0;
      while (off < n) {
        ssize_t w = ::write(log_fd_, buf + off, n - off);
        if (w <= 0) break;
        off += w;
      }
    }
    partial.append(buf, static_cast<size_t>(n));
    size_t pos;
    std::vector<std::string> complete;
    while ((pos = partial.find('\n')) != std::string::npos) {
      complete.push_back(partial.substr(0, pos));
      partial.erase(0, pos + 1);
    }
    if (!complete.empty()) {
      absl::MutexLock l(&mu_);
      for (auto& line : complete) lines_.push_back(std::move(line));
    }
  }
  ::close(fd);
  absl::MutexLock l(&mu_);
  if (!partial.empty()) lines_.push_back(partial);
  stdout_closed_ = true;
}

absl::StatusOr<std::string> Process::WaitForLine(
    const std::function<bool(const std::string&)>& pred, absl::Duration timeout) const {
  absl::MutexLock l(&mu_);
  size_t checked = 0;
  std::string found;
  bool have = false;
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    for (; checked < lines_.size(); ++checked) {
      if (pred(lines_[checked])) {
        found = lines_[checked];
        have = true;
        return true;
      }
    }
    return stdout_closed_ && exited_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (have) return found;
  if (stdout_closed_ && exited_) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, " exited with status ", exit_status_, " before the awaited line"));
  }
  return absl::DeadlineExceededError(absl::StrCat(name_, ": awaited line not seen within ",
                                                  absl::FormatDuration(timeout)));
}

absl::StatusOr<nlohmann::json> Process::WaitForEvent(const std::string& event, uint64_t version,
                                                     absl::Duration timeout) const {
  auto match = [&](const std::string& line) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("event")) return false;
    if (!j["event"].is_string() || j["event"].get<std::string>() != event) return false;
    if (version == 0) return true;
    return j.contains("version") && j["version"].is_number_unsigned() &&
           j["version"].get<uint64_t>() == version;
  };
  auto line = WaitForLine(match, timeout);
  if (!line.ok()) {
    return absl::Status(line.status().code(),
                        absl::StrCat(line.status().message(), " (waiting for event '", event,
                                     "' v", version, ")\n--- log tail of ", name_, " ---\n",
                                     LogTail(3000)));
  }
  return nlohmann::json::parse(*line, nullptr, false);
}

std::vector<std::string> Process::Lines() const {
  absl::MutexLock l(&mu_);
  return lines_;
}

std::vector<nlohmann::json> Process::Events() const {
  std::vector<nlohmann::json> out;
  for (const auto& line : Lines()) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("event")) out.push_back(std::move(j));
  }
  return out;
}

std::string Process::LogTail(size_t bytes) const {
  std::ifstream in(log_path_, std::ios::binary);
  if (!in) return "(no log)";
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

// ---------------------------------------------------------------------------------- Harness

absl::StatusOr<std::unique_ptr<Harness>> Harness::Create(const std::string& tag) {
  std::string tmpl = absl::StrCat("/tmp/wb-", tag.substr(0, 16), "-XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<Harness>(new Harness(buf.data()));
}

Harness::~Harness() {
  KillAll();
  {
    absl::MutexLock l(&mu_);
    // A worker killed with SIGKILL cannot unlink its shared memory: remove every segment a child
    // announced ({"shm": NAME} in a progress line). Already-unlinked names just fail with ENOENT.
    for (const auto& p : procs_) {
      for (const auto& e : p->Events()) {
        if (e.contains("shm") && e["shm"].is_string()) {
          ::shm_unlink(e["shm"].get<std::string>().c_str());
        }
      }
    }
    procs_.clear();
  }
  const char* keep = std::getenv("WB_E2E_KEEP");
  if (keep != nullptr && std::string(keep) == "1") {
    std::fprintf(stderr, "harness: kept %s\n", dir_.c_str());
  } else {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

void Harness::KillAll() {
  std::vector<Process*> procs;
  {
    absl::MutexLock l(&mu_);
    for (auto& p : procs_) procs.push_back(p.get());
  }
  for (Process* p : procs) p->Signal(SIGKILL);
  for (Process* p : procs) (void)p->WaitExit(absl::Seconds(10));
}

absl::StatusOr<Process*> Harness::Spawn(const std::string& name,
                                        const std::vector<std::string>& argv,
                                        const std::vector<std::string>& env) {
  if (argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  if (::access(argv[0].c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("Spawn ", name, ": ", argv[0], " is not executable"));
  }
  auto proc = std::unique_ptr<Process>(new Process());
  proc->name_ = name;
  proc->log_path_ = Path(name + ".log");
  proc->log_fd_ = ::open(proc->log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (proc->log_fd_ < 0) {
    return absl::InternalError(absl::StrCat("open ", proc->log_path_, ": ", std::strerror(errno)));
  }
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  // Everything the child needs is prepared before fork: only async-signal-safe calls after it.
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
  for (const auto& e : env) envs.push_back(e);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  const int log_fd = proc->log_fd_;
  const pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl took effect
    ::setpgid(0, 0);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  proc->pid_ = pid;
  Process* raw = proc.get();
  raw->reader_ = std::thread([raw, fd = out[0]] { raw->ReaderLoop(fd); });
  raw->reaper_ = std::thread([raw] { raw->ReaperLoop(); });
  absl::MutexLock l(&mu_);
  procs_.push_back(std::move(proc));
  return raw;
}

absl::StatusOr<int> Harness::WaitForPortFile(const std::string& path, absl::Duration timeout,
                                             const Process* owner) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    // inotify-based wait in slices, so a daemon that died is reported at once rather than at the
    // deadline.
    absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(250));
    auto content = WaitForFile(path, slice);
    if (content.ok()) {
      int port = 0;
      std::string text(absl::StripAsciiWhitespace(*content));
      if (!absl::SimpleAtoi(text, &port) || port <= 0 || port > 65535) {
        return absl::InvalidArgumentError(
            absl::StrCat("port file ", path, " holds '", text, "', not a port"));
      }
      return port;
    }
    if (content.status().code() != absl::StatusCode::kDeadlineExceeded) return content.status();
    if (owner != nullptr && owner->Exited()) {
      return absl::FailedPreconditionError(absl::StrCat(owner->name(), " exited before writing ",
                                                        path, "\n--- log tail ---\n",
                                                        owner->LogTail(3000)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no port in ", path, " within ",
                                                      absl::FormatDuration(timeout)));
    }
  }
}

absl::Status Harness::Touch(const std::string& path) {
  // Written then renamed, so a watcher never sees a half-made file.
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << "go\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace wb::e2e

#include "daemon/node/live_markers.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/log.h"
#include "daemon/node/state_files.h"

namespace wb::daemon {
namespace {

constexpr char kHeader[] = "weightbridge-live-marker 1";
constexpr char kPrefix[] = "live-";
constexpr char kSuffix[] = ".marker";

std::string Errno(const std::string& what, const std::string& path) { return state_files::ErrnoMessage(what, path); }

// Creates `dir` 0700 when missing; checks it is a directory of ours, private.
absl::Status EnsurePrivateDir(const std::string& dir, bool create) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT || !create) return absl::FailedPreconditionError(Errno("live state directory: cannot stat", dir));
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(Errno("live state directory: cannot create", dir) + " (set --live_state_dir)");
    }
    if (::lstat(dir.c_str(), &st) != 0) return absl::FailedPreconditionError(Errno("live state directory: cannot stat", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("live state directory ", dir, " is not a directory (a symlink or a file); set --live_state_dir"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat("live state directory ", dir, " is owned by uid ", st.st_uid, ", not by this daemon's uid ",
                                                    ::geteuid(), ": refusing it (another user could forge or remove markers); set --live_state_dir"));
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return absl::PermissionDeniedError(absl::StrCat("live state directory ", dir, " has mode ", mode,
                                                    ": it must be private to this user (chmod 0700 it or set --live_state_dir)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SegmentId> Identify(const std::string& name) {
  const std::string path = absl::StrCat("/dev/shm", name.empty() || name[0] != '/' ? "/" : "", name);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(Errno("cannot stat segment", path));
  return SegmentId{name, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

}  // namespace

absl::StatusOr<std::vector<SegmentId>> IdentifySegments(const std::vector<std::shared_ptr<transport::ShmSegment>>& segments) {
  std::vector<SegmentId> out;
  for (const auto& s : segments) {
    if (s == nullptr) continue;
    auto id = Identify(s->name());
    if (!id.ok()) return id.status();
    out.push_back(std::move(*id));
  }
  return out;
}

std::string LiveMarkers::DefaultDir() {
  if (const char* sd = std::getenv("STATE_DIRECTORY"); sd != nullptr && sd[0] == '/') {
    // systemd may list several directories separated by ':'; the first is ours.
    return absl::StrCat(std::string(sd).substr(0, std::string(sd).find(':')), "/live");
  }
  const char* tmp = std::getenv("TMPDIR");
  return absl::StrCat(tmp != nullptr && tmp[0] == '/' ? tmp : "/tmp", "/weightbridge-", ::geteuid(), "/live");
}

absl::StatusOr<std::unique_ptr<LiveMarkers>> LiveMarkers::Open(const std::string& dir, const std::string& node_id) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("--live_state_dir must be an absolute path, got \"", dir, "\""));
  }
  const size_t slash = dir.find_last_of('/');
  if (slash > 0) {
    // A missing parent (the default's weightbridge-<uid>) is created private too; an existing one
    // is left as it is (e.g. /var/lib).
    struct stat st;
    const std::string parent = dir.substr(0, slash);
    if (::lstat(parent.c_str(), &st) != 0 && errno == ENOENT) {
      if (absl::Status s = EnsurePrivateDir(parent, true); !s.ok()) return s;
    }
  }
  if (absl::Status s = EnsurePrivateDir(dir, true); !s.ok()) return s;
  std::unique_ptr<LiveMarkers> m(new LiveMarkers(dir, node_id));
  m->LoadLeftovers();
  return m;
}

std::string LiveMarkers::PathFor(const std::string& worker) const {
  return absl::StrCat(dir_, "/", kPrefix, state_files::StableHex(absl::StrCat(node_, std::string(1, '\0'), worker)), kSuffix);
}

std::string LiveMarkers::Serialize(const LiveMarker& m) {
  std::string out = absl::StrCat(kHeader, "\n");
  absl::StrAppend(&out, "node=", absl::CEscape(m.node), "\n", "model=", absl::CEscape(m.model), "\n", "worker=", absl::CEscape(m.worker),
                  "\n", "writing=", m.writing, "\n", "over=", m.over, "\n", "daemon_pid=", m.daemon_pid, "\n", "reason=",
                  absl::CEscape(m.reason.substr(0, 1024)), "\n");
  for (const SegmentId& s : m.segments) absl::StrAppend(&out, "segment=", s.dev, ":", s.ino, ":", absl::CEscape(s.name), "\n");
  return out;
}

absl::StatusOr<LiveMarker> LiveMarkers::Parse(const std::string& text) {
  if (text.size() > static_cast<size_t>(kMaxFileBytes)) return absl::InvalidArgumentError(absl::StrCat("marker of ", text.size(), " bytes"));
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kHeader) return absl::InvalidArgumentError("marker without its header line");
  LiveMarker m;
  bool have_worker = false, have_model = false, have_writing = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    const size_t eq = line.find('=');
    auto bad = [&] { return absl::InvalidArgumentError(absl::StrCat("marker line ", i + 1, " is not valid: \"", line.substr(0, 80), "\"")); };
    if (eq == std::string::npos) return bad();
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    std::string text_value;
    if (key == "node" || key == "model" || key == "worker" || key == "reason") {
      if (!absl::CUnescape(value, &text_value)) return bad();
      if (key == "node") m.node = text_value;
      if (key == "model") m.model = text_value, have_model = true;
      if (key == "worker") m.worker = text_value, have_worker = true;
      if (key == "reason") m.reason = text_value;
    } else if (key == "writing") {
      if (!absl::SimpleAtoi(value, &m.writing)) return bad();
      have_writing = true;
    } else if (key == "over") {
      if (!absl::SimpleAtoi(value, &m.over)) return bad();
    } else if (key == "daemon_pid") {
      if (!absl::SimpleAtoi(value, &m.daemon_pid)) return bad();
    } else if (key == "segment") {
      std::vector<std::string> f = absl::StrSplit(value, absl::MaxSplits(':', 2));
      SegmentId s;
      if (f.size() != 3 || !absl::SimpleAtoi(f[0], &s.dev) || !absl::SimpleAtoi(f[1], &s.ino) || !absl::CUnescape(f[2], &s.name)) return bad();
      if (m.segments.size() >= 1024) return bad();
      m.segments.push_back(std::move(s));
    } else {
      return bad();
    }
  }
  if (!have_worker || !have_model || !have_writing) return absl::InvalidArgumentError("marker without model, worker or writing");
  return m;
}

absl::Status LiveMarkers::WriteLocked(const LiveMarker& m) {
  const std::string text = Serialize(m);
  if (text.size() > static_cast<size_t>(kMaxFileBytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("live-copy marker of worker ", m.worker, " would be ", text.size(), " bytes (limit ",
                                                     kMaxFileBytes, ")"));
  }
  if (current_.count(m.worker) == 0 && current_.size() + leftovers_.size() >= kMaxMarkers) {
    return absl::ResourceExhaustedError(absl::StrCat("node ", node_, " holds ", kMaxMarkers, " live-copy markers in ", dir_,
                                                     " (the limit): cannot record the copy into worker ", m.worker));
  }
  const std::string path = PathFor(m.worker);
  const std::string tmp = absl::StrCat(path, ".tmp");
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(Errno("cannot write live-copy marker", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string err = Errno("cannot write live-copy marker", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::UnavailableError(err);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = Errno("cannot rename live-copy marker to", path);
    ::unlink(tmp.c_str());
    return absl::UnavailableError(err);
  }
  current_[m.worker] = m;
  return absl::OkStatus();
}

absl::Status LiveMarkers::Record(const LiveMarker& marker) {
  LiveMarker m = marker;
  m.node = node_;
  m.daemon_pid = ::getpid();
  absl::MutexLock l(&mu_);
  leftovers_.erase(m.worker);  // this process's marker replaces the earlier one (same file)
  return WriteLocked(m);
}

void LiveMarkers::MarkFailed(const std::string& worker, uint64_t writing, uint64_t over, const std::string& reason) {
  absl::MutexLock l(&mu_);
  auto it = current_.find(worker);
  if (it == current_.end()) return;
  LiveMarker m = it->second;
  m.writing = writing;
  m.over = over;
  m.reason = reason;
  if (absl::Status s = WriteLocked(m); !s.ok()) {
    // The marker written at the copy's start stays: it already says torn, with the versions.
    Log(LogLevel::kWarning, "live-copy marker not updated", {{"worker", worker}, {"error", s.message()}});
  }
}

void LiveMarkers::Clear(const std::string& worker) {
  absl::MutexLock l(&mu_);
  // An earlier process's leftover stays until Claim: the worker's RegisterWorker forgets its live
  // state (LiveState::Forget) before its RegisterLayout says which memory it brings.
  if (current_.erase(worker) > 0) ::unlink(PathFor(worker).c_str());
}

std::optional<LiveMarker> LiveMarkers::Claim(const std::string& model, const std::string& worker, const std::vector<SegmentId>& segments) {
  absl::MutexLock l(&mu_);
  auto it = leftovers_.find(worker);
  if (it == leftovers_.end()) return std::nullopt;
  LiveMarker m = std::move(it->second);
  leftovers_.erase(it);
  if (m.model != model || m.segments != segments || segments.empty()) {
    ::unlink(PathFor(worker).c_str());
    Log(LogLevel::kInfo, "live-copy marker of another memory dropped", {{"node", node_}, {"worker", worker}, {"model", model}});
    return std::nullopt;
  }
  current_[worker] = m;  // this process owns the file now: Clear / MarkFailed / Record update it
  return m;
}

size_t LiveMarkers::leftovers() const {
  absl::MutexLock l(&mu_);
  return leftovers_.size();
}

void LiveMarkers::LoadLeftovers() {
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrefix, 0) != 0) continue;
    names.push_back(name);
    if (names.size() > 4 * kMaxMarkers) break;  // a flooded directory: read a bounded share
  }
  ::closedir(d);
  absl::MutexLock l(&mu_);
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(dir_, "/", name);
    auto drop = [&](absl::string_view why) {
      Log(LogLevel::kWarning, "live-copy marker dropped", {{"node", node_}, {"file", path}, {"why", why}});
      ::unlink(path.c_str());
    };
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat st;
    std::string text;
    bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (regular && st.st_size <= kMaxFileBytes) {
      text.resize(static_cast<size_t>(st.st_size));
      const ssize_t n = ::read(fd, text.data(), text.size());
      text.resize(n > 0 ? static_cast<size_t>(n) : 0);
    }
    ::close(fd);
    auto m = regular && st.st_size <= kMaxFileBytes ? Parse(text) : absl::StatusOr<LiveMarker>(absl::InvalidArgumentError("not a small regular file"));
    if (tmp) {
      // Being written by another daemon sharing the directory, or left by an earlier process of ours.
      if (m.ok() && m->node == node_) drop("an unfinished write of an earlier process");
      continue;
    }
    if (!m.ok()) {
      // Corrupt: whose it is cannot be told; it has our name pattern and guards nothing readable.
      drop(m.status().message());
      continue;
    }
    if (m->node != node_) continue;  // another node daemon's (sharing the directory)
    if (PathFor(m->worker) != path) {
      drop("file name does not match its worker");
      continue;
    }
    bool alive = !m->segments.empty();
    for (const SegmentId& s : m->segments) {
      auto now = Identify(s.name);
      alive = alive && now.ok() && *now == s;
    }
    if (!alive) {
      drop("its worker's memory is gone");
      continue;
    }
    if (leftovers_.size() >= kMaxMarkers) {
      drop("more markers than the limit");
      continue;
    }
    Log(LogLevel::kWarning, "live weights torn by an earlier daemon process",
        {{"node", node_}, {"model", m->model}, {"worker", m->worker}, {"version", m->writing}, {"over", m->over}, {"pid", m->daemon_pid}});
    leftovers_[m->worker] = std::move(*m);
  }
}

}  // namespace wb::daemon

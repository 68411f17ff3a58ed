#include "daemon/node/publish_record.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/log.h"
#include "daemon/node/state_files.h"

namespace wb::daemon::node {
namespace {

constexpr char kHeader[] = "weightbridge-publish-record 1";

std::string Errno(const std::string& what, const std::string& path) { return state_files::ErrnoMessage(what, path); }

// The whole file, at most PublishRecord::kMaxFileBytes; nullopt when there is none.
absl::StatusOr<std::optional<std::string>> ReadSmallFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    return absl::FailedPreconditionError(Errno("cannot open", path));
  }
  std::string text;
  char buf[8192];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > PublishRecord::kMaxFileBytes) break;
  }
  ::close(fd);
  if (static_cast<int64_t>(text.size()) > PublishRecord::kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("more than ", PublishRecord::kMaxFileBytes, " bytes"));
  }
  return std::optional<std::string>(std::move(text));
}

}  // namespace

std::string PublishRecord::Serialize(const std::vector<PublishEntry>& entries) {
  std::string out = absl::StrCat(kHeader, "\n");
  // CEscape leaves no tab or newline in a field: one entry per line, fields split by tabs.
  for (const PublishEntry& e : entries) {
    absl::StrAppend(&out, absl::CEscape(e.model), "\t", absl::CEscape(e.worker), "\t", absl::CEscape(e.process), "\t", e.version, "\t",
                    absl::CEscape(e.instance), "\n");
  }
  return out;
}

absl::StatusOr<std::vector<PublishEntry>> PublishRecord::Parse(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kHeader) return absl::InvalidArgumentError("publish record without its header line");
  std::vector<PublishEntry> out;
  for (size_t i = 1; i < lines.size(); ++i) {
    auto bad = [&] { return absl::InvalidArgumentError(absl::StrCat("publish record line ", i + 1, " is not valid: \"", lines[i].substr(0, 80), "\"")); };
    std::vector<std::string> f = absl::StrSplit(lines[i], '\t');
    PublishEntry e;
    if (f.size() != 5 || !absl::CUnescape(f[0], &e.model) || !absl::CUnescape(f[1], &e.worker) || !absl::CUnescape(f[2], &e.process) ||
        !absl::SimpleAtoi(f[3], &e.version) || !absl::CUnescape(f[4], &e.instance) || e.model.empty() || e.worker.empty() || e.process.empty() ||
        e.version == 0) {
      return bad();
    }
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PublishRecord>> PublishRecord::Open(const std::string& dir, const std::string& node_id,
                                                                   const std::function<bool(const std::string& process)>& alive) {
  std::unique_ptr<PublishRecord> r(new PublishRecord(absl::StrCat(dir, "/publish-", state_files::StableHex(node_id), ".record")));
  absl::StatusOr<std::optional<std::string>> text = ReadSmallFile(r->path_);
  absl::StatusOr<std::vector<PublishEntry>> entries =
      !text.ok() ? absl::StatusOr<std::vector<PublishEntry>>(text.status()) : !text->has_value() ? std::vector<PublishEntry>() : Parse(**text);
  absl::MutexLock l(&r->mu_);
  if (!entries.ok()) {
    // An unreadable, torn or foreign file: what it said is lost (the behaviour before the record,
    // no worse), never a crash nor a daemon that does not start.
    Log(LogLevel::kWarning, "publish record dropped: not readable or not valid",
        {{"node", node_id}, {"path", r->path_}, {"error", entries.status().message()}});
    ::unlink(r->path_.c_str());
    return r;
  }
  size_t dropped = 0;
  for (const PublishEntry& e : *entries) {
    if (alive && !alive(e.process)) {
      ++dropped;  // that trainer process is gone: no one inherits its record
      continue;
    }
    r->PutLocked(e);
  }
  if (dropped > 0 || !entries->empty()) {
    Log(LogLevel::kInfo, "publish record read", {{"node", node_id}, {"kept", r->entries_.size()}, {"dropped", dropped}});
  }
  if (dropped > 0) (void)r->WriteLocked();
  return r;
}

void PublishRecord::PutLocked(const PublishEntry& e) {
  const Key key{e.model, e.worker};
  if (auto it = entries_.find(key); it != entries_.end()) {
    order_.erase(it->second.second);
    entries_.erase(it);
  }
  order_.push_back(key);
  entries_.emplace(key, std::make_pair(e, std::prev(order_.end())));
  while (entries_.size() > kMaxEntries) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
}

absl::Status PublishRecord::Note(const PublishEntry& e) {
  absl::MutexLock l(&mu_);
  if (auto it = entries_.find({e.model, e.worker}); it != entries_.end()) {
    const PublishEntry& old = it->second.first;
    if (old == e || (old.process == e.process && old.version > e.version)) return absl::OkStatus();  // nothing newer
  }
  PutLocked(e);
  return WriteLocked();
}

std::optional<PublishEntry> PublishRecord::Find(const std::string& model, const std::string& worker) const {
  absl::MutexLock l(&mu_);
  auto it = entries_.find({model, worker});
  if (it == entries_.end()) return std::nullopt;
  return it->second.first;
}

void PublishRecord::Forget(const std::string& model, const std::string& worker) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find({model, worker});
  if (it == entries_.end()) return;
  order_.erase(it->second.second);
  entries_.erase(it);
  (void)WriteLocked();
}

size_t PublishRecord::size() const {
  absl::MutexLock l(&mu_);
  return entries_.size();
}

absl::Status PublishRecord::WriteLocked() {
  if (entries_.empty()) {
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) return absl::InternalError(Errno("cannot remove", path_));
    return absl::OkStatus();
  }
  std::vector<PublishEntry> all;
  all.reserve(entries_.size());
  for (const Key& k : order_) all.push_back(entries_.at(k).first);
  const std::string text = Serialize(all);
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return absl::InternalError(Errno("cannot create", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status s = absl::InternalError(Errno("cannot write", tmp));
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    const absl::Status s = absl::InternalError(Errno("cannot rename into", path_));
    ::unlink(tmp.c_str());
    return s;
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon::node

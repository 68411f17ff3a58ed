#include "transport/shm_segment.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wb::transport {
namespace {

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view name) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case ENOENT: code = absl::StatusCode::kNotFound; break;
    case EEXIST: code = absl::StatusCode::kAlreadyExists; break;
    case EACCES:
    case EPERM: code = absl::StatusCode::kPermissionDenied; break;
    case EINVAL:
    case ENAMETOOLONG: code = absl::StatusCode::kInvalidArgument; break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE: code = absl::StatusCode::kResourceExhausted; break;
    default: break;
  }
  return absl::Status(code, absl::StrCat(what, " shared memory segment '", name, "': ", ErrnoText(err)));
}

absl::StatusOr<void*> MapFd(int fd, int64_t size, bool populate, const std::string& name) {
  if (size == 0) return nullptr;  // mmap of length 0 is invalid; an empty segment maps to nothing.
  int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, flags, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap", name);
  return p;
}

}  // namespace

absl::Status ShmSegment::ValidateName(absl::string_view name) {
  if (name.size() < 2 || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", name, "' must start with '/' and have at least one more character"));
  }
  if (name.substr(1).find('/') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory name '", name, "' contains a second '/'"));
  }
  if (name.size() > NAME_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory name '", name.substr(0, 32), "...' is longer than ", NAME_MAX, " characters"));
  }
  return absl::OkStatus();
}

std::string ShmSegment::UniqueName(absl::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return absl::StrCat("/wb-", prefix, "-", getpid(), "-", counter.fetch_add(1), "-", salt % 1000000007);
}

absl::StatusOr<ShmSegment> ShmSegment::Create(const std::string& name, int64_t size_bytes,
                                              const CreateOptions& options) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (size_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory segment '", name, "': negative size ", size_bytes));
  }
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "create", name);
  ShmSegment seg;
  seg.name_ = name;
  seg.fd_ = fd;
  seg.created_ = true;
  seg.unlink_on_destroy_ = true;  // from here on, any failure unlinks via the destructor
  // The umask may have cleared bits but never adds any; enforce exactly 0600 anyway.
  if (fchmod(fd, 0600) != 0) return ErrnoStatus(errno, "fchmod", name);
  if (ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) return ErrnoStatus(errno, "ftruncate", name);
  auto mapped = MapFd(fd, size_bytes, options.populate, name);
  if (!mapped.ok()) return mapped.status();
  seg.data_ = *mapped;
  seg.size_ = size_bytes;
  return seg;
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name, int64_t expected_size) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "open", name);
  ShmSegment seg;
  seg.name_ = name;
  seg.fd_ = fd;
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", name);
  if (expected_size >= 0 && st.st_size != expected_size) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory segment '", name, "' has ", st.st_size,
                                                   " bytes, expected ", expected_size));
  }
  auto mapped = MapFd(fd, st.st_size, /*populate=*/false, name);
  if (!mapped.ok()) return mapped.status();
  seg.data_ = *mapped;
  seg.size_ = st.st_size;
  return seg;
}

absl::Status ShmSegment::Unlink(const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (shm_unlink(name.c_str()) != 0) return ErrnoStatus(errno, "unlink", name);
  return absl::OkStatus();
}

absl::StatusOr<uid_t> ShmSegment::OwnerUid() const {
  if (fd_ < 0) return absl::FailedPreconditionError("OwnerUid on an empty ShmSegment");
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  return st.st_uid;
}

absl::Status ShmSegment::CheckOwner(uid_t uid) const {
  if (fd_ < 0) return absl::FailedPreconditionError("CheckOwner on an empty ShmSegment");
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "fstat", name_);
  if (st.st_uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("shared memory segment '", name_, "' is owned by uid ",
                                                    st.st_uid, ", expected uid ", uid));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("shared memory segment '", name_, "' has mode 0",
                                                    absl::StrFormat("%o", st.st_mode & 0777),
                                                    ": group/other access is not allowed (want 0600)"));
  }
  return absl::OkStatus();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    created_ = std::exchange(other.created_, false);
    unlink_on_destroy_ = std::exchange(other.unlink_on_destroy_, false);
    other.name_.clear();
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  if (fd_ >= 0) close(fd_);
  if (unlink_on_destroy_ && !name_.empty()) shm_unlink(name_.c_str());
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
  created_ = false;
  unlink_on_destroy_ = false;
  name_.clear();
}

}  // namespace wb::transport

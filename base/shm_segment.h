#pragma once
// POSIX shared memory segments: the memory that CPU-mode workers keep their weights in and that
// the node daemon maps (design.md "Data plane", host same-node transport).
//
// Contract:
//  - Create() makes a NEW segment (fails with ALREADY_EXISTS if the name is taken), mode 0600,
//    sized to `size_bytes` (zero-filled by the kernel), mapped read/write. The creating object
//    unlinks the name on destruction unless set_unlink_on_destroy(false) was called (a worker that
//    hands its segment to a daemon typically keeps the default and outlives the transfer).
//  - Open() maps an EXISTING segment read/write; its size is taken from fstat. If `expected_size`
//    is >= 0 the segment must be exactly that large (INVALID_ARGUMENT otherwise). Open() never
//    unlinks on destruction. It opens with O_NOFOLLOW | O_NONBLOCK and refuses (INVALID_ARGUMENT)
//    anything but a regular file: a FIFO or device named as a segment never blocks the caller.
//  - CheckOwner(uid) verifies (via fstat of the open descriptor, so no TOCTOU on the name) that the
//    segment belongs to `uid` and grants no group/other access: the daemon calls it before trusting
//    a worker-supplied name.
//  - Names follow POSIX: a leading '/', no other '/', at most NAME_MAX characters; violations are
//    INVALID_ARGUMENT. Errors carry the segment name and the errno text.
//  - Move-only RAII: the mapping and descriptor are released in the destructor. A moved-from
//    object is empty (data() == nullptr). Not thread-safe for concurrent mutation of the object
//    itself; the mapped memory may of course be used from any thread.

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

class ShmSegment {
 public:
  struct CreateOptions {
    // Pre-fault every page (MAP_POPULATE) so the first copy into the segment does not pay page
    // faults: benches and large staging buffers want this, tiny test segments do not care.
    bool populate = false;
  };

  static absl::StatusOr<ShmSegment> Create(const std::string& name, int64_t size_bytes,
                                           const CreateOptions& options);
  static absl::StatusOr<ShmSegment> Create(const std::string& name, int64_t size_bytes) {
    return Create(name, size_bytes, CreateOptions());
  }
  static absl::StatusOr<ShmSegment> Open(const std::string& name, int64_t expected_size = -1);
  // Removes the name (mapped segments stay valid until unmapped). NOT_FOUND if absent.
  static absl::Status Unlink(const std::string& name);
  // A fresh, valid, practically unique name: "/wb-<prefix>-<pid>-<counter>-<random>".
  static std::string UniqueName(absl::string_view prefix);
  // INVALID_ARGUMENT naming the problem if `name` is not a valid POSIX shm name.
  static absl::Status ValidateName(absl::string_view name);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  void* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool created() const { return created_; }

  // Owner uid of the open segment (fstat). 
  absl::StatusOr<uid_t> OwnerUid() const;
  // PERMISSION_DENIED unless owned by `uid` with no group/other permission bits.
  absl::Status CheckOwner(uid_t uid) const;

  void set_unlink_on_destroy(bool unlink) { unlink_on_destroy_ = unlink; }

  // Memory another process owns can shrink under us (a worker truncating its own segment): a
  // read or write past the new end raises SIGBUS, which would kill the whole daemon.
  //  - CheckIntact(): FAILED_PRECONDITION naming the segment when it is no longer a regular file
  //    of at least the mapped size (fstat of the open descriptor), or when the guard below caught
  //    a fault in it. Call before each use; a segment that failed it stays failed.
  //  - InstallSigbusGuard(): once per process (idempotent). From then on segments mapped by Open()
  //    are registered with a process-wide SIGBUS handler: a fault inside one replaces the rest of
  //    that mapping (from the faulting page) with anonymous zero pages (MAP_FIXED, async-signal-
  //    safe), marks the segment faulted and returns, so the copy in progress finishes on garbage
  //    and its owner reports the error for that segment only (CheckIntact after the copy). A SIGBUS
  //    anywhere else takes the previous action (default: the process dies). At most 65536
  //    segments are guarded at once; more are mapped unguarded.
  absl::Status CheckIntact() const;
  // Pre-faults every page of the mapping for writing (MADV_POPULATE_WRITE), on up to `threads`
  // threads, without changing a byte: the daemon calls it for a rollout's live buffers when they
  // are registered, so the first copy into them (a sync commit, an Apply, a catch-up) does not pay
  // page allocation and mapping faults inside a version's critical path. Then reads one byte per
  // page through this mapping (a VM shadowing page tables traps the first access per page and
  // mapping even after the populate). OK and a no-op on kernels without MADV_POPULATE_WRITE
  // (before 5.14); an error (e.g. the segment was truncated under us) names the segment.
  absl::Status Populate(int threads = 4) const;
  // PERMISSION_DENIED naming the mode unless the segment grants no group/other access (0600): a
  // segment others may write can change under a version.
  absl::Status CheckPrivate() const;
  bool faulted() const;
  static void InstallSigbusGuard();

 private:
  void Reset();
  int guard_slot_ = -1;  // slot in the SIGBUS guard's table, -1 = not guarded

  std::string name_;
  int fd_ = -1;
  void* data_ = nullptr;
  int64_t size_ = 0;
  bool created_ = false;
  bool unlink_on_destroy_ = false;
};

}  // namespace wb::transport

// ThreadSanitizer builds only (--config=tsan, see docs/sanitizers.md). Debian's libabsl_synchronization
// is not compiled with -fsanitize=thread, so TSan cannot see absl::Mutex / absl::CondVar hand memory
// from one thread to the next: every access guarded by an absl::Mutex would be reported as a race.
// This file interposes the exported lock/unlock/wait entry points (the executable's definitions win
// over the shared library's), calls the real ones through dlsym(RTLD_NEXT), and tells TSan about the
// happens-before edge: release on the mutex address before unlocking, acquire after locking.
// It only adds synchronisation TSan would have seen with an instrumented absl; it changes no behaviour.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

// Suppressions compiled into every TSan binary (TSan reads this weak hook at start-up, so child
// processes that tests spawn get the same list without any environment). What is suppressed and
// why is in docs/sanitizers.md; //tests/tsan:canary_test proves races in our own code, including
// inside gRPC handlers, are still reported with this list in place.
//
// called_from_lib: the library is not instrumented, so TSan cannot see the synchronisation inside
// it; it can only see the libc calls it makes (malloc/free/memcpy/sendmsg...), which then look
// unordered against everything else. This setting makes TSan ignore exactly those calls.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgrpc++.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libupb.so\n"
         "called_from_lib:libaddress_sorting.so\n"
         "called_from_lib:libprotobuf.so\n"
         // TLS on the control plane: OpenSSL decrypts into buffers gRPC then hands to our parsers.
         "called_from_lib:libssl.so\n"
         "called_from_lib:libcrypto.so\n"
         // One entry per library: an entry matching two libraries is a fatal TSan error.
         "called_from_lib:libabsl_status.so\n"
         "called_from_lib:libabsl_statusor.so\n"
         "called_from_lib:libabsl_cord.so\n"
         "called_from_lib:libabsl_cord_internal.so\n"
         "called_from_lib:libabsl_strings.so\n"
         "called_from_lib:libabsl_str_format_internal.so\n"
         "called_from_lib:libabsl_synchronization.so\n"
         "called_from_lib:libabsl_graphcycles_internal.so\n";
}

namespace {

template <typename Fn>
Fn Real(const char* mangled) {
  void* p = dlsym(RTLD_NEXT, mangled);
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found: %s\n", mangled, dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(p);
}

#define WB_REAL(type, mangled)                   \
  static const auto real = Real<type>(mangled);

void Acquire(const absl::Mutex* mu) { __tsan_acquire(const_cast<absl::Mutex*>(mu)); }
void Release(const absl::Mutex* mu) { __tsan_release(const_cast<absl::Mutex*>(mu)); }

using M = absl::Mutex;
using C = absl::Condition;

// absl evaluates an Await/LockWhen condition while the mutex is held, but possibly in another
// thread (the one unlocking) and inside the real call, after our release/before our acquire.
// Each evaluation is therefore bracketed with acquire/release on the mutex: it sees every earlier
// critical section and is seen by every later one, exactly as if it were a critical section itself.
struct Traced {
  const C* cond;
  M* mu;
  static bool Eval(Traced* t) {
    Acquire(t->mu);
    bool r = t->cond->Eval();
    Release(t->mu);
    return r;
  }
  C Wrap() { return C(&Traced::Eval, this); }
};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  WB_REAL(void (*)(M*), "_ZN4absl7debian35Mutex4LockEv");
  real(this);
  Acquire(this);
}
void Mutex::Unlock() {
  WB_REAL(void (*)(M*), "_ZN4absl7debian35Mutex6UnlockEv");
  Release(this);
  real(this);
}
bool Mutex::TryLock() {
  WB_REAL(bool (*)(M*), "_ZN4absl7debian35Mutex7TryLockEv");
  bool ok = real(this);
  if (ok) Acquire(this);
  return ok;
}
void Mutex::ReaderLock() {
  WB_REAL(void (*)(M*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  real(this);
  Acquire(this);
}
void Mutex::ReaderUnlock() {
  WB_REAL(void (*)(M*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  Release(this);
  real(this);
}
bool Mutex::ReaderTryLock() {
  WB_REAL(bool (*)(M*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  bool ok = real(this);
  if (ok) Acquire(this);
  return ok;
}
// Await/LockWhen: absl may evaluate the condition in whichever thread releases the mutex; that
// thread holds the mutex, so the release/acquire pairs above and below order those reads too.
void Mutex::Await(const C& cond) {
  WB_REAL(void (*)(M*, const C&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  Release(this);
  Traced t{&cond, this};
  real(this, t.Wrap());
  Acquire(this);
}
bool Mutex::AwaitWithTimeout(const C& cond, absl::Duration timeout) {
  WB_REAL(bool (*)(M*, const C&, absl::Duration),
          "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Release(this);
  Traced t{&cond, this};
  bool ok = real(this, t.Wrap(), timeout);
  Acquire(this);
  return ok;
}
bool Mutex::AwaitWithDeadline(const C& cond, absl::Time deadline) {
  WB_REAL(bool (*)(M*, const C&, absl::Time), "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Release(this);
  Traced t{&cond, this};
  bool ok = real(this, t.Wrap(), deadline);
  Acquire(this);
  return ok;
}
void Mutex::LockWhen(const C& cond) {
  WB_REAL(void (*)(M*, const C&), "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  Traced t{&cond, this};
  real(this, t.Wrap());
  Acquire(this);
}
void Mutex::ReaderLockWhen(const C& cond) {
  WB_REAL(void (*)(M*, const C&), "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Traced t{&cond, this};
  real(this, t.Wrap());
  Acquire(this);
}
bool Mutex::LockWhenWithTimeout(const C& cond, absl::Duration timeout) {
  WB_REAL(bool (*)(M*, const C&, absl::Duration),
          "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Traced t{&cond, this};
  bool ok = real(this, t.Wrap(), timeout);  // holds the mutex either way
  Acquire(this);
  return ok;
}
bool Mutex::LockWhenWithDeadline(const C& cond, absl::Time deadline) {
  WB_REAL(bool (*)(M*, const C&, absl::Time),
          "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Traced t{&cond, this};
  bool ok = real(this, t.Wrap(), deadline);
  Acquire(this);
  return ok;
}

void CondVar::Wait(Mutex* mu) {
  WB_REAL(void (*)(CondVar*, M*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  real(this, mu);
  Acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  WB_REAL(bool (*)(CondVar*, M*, absl::Duration), "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Release(mu);
  bool ok = real(this, mu, timeout);
  Acquire(mu);
  return ok;
}
bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  WB_REAL(bool (*)(CondVar*, M*, absl::Time), "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  bool ok = real(this, mu, deadline);
  Acquire(mu);
  return ok;
}

// absl::Status shares its heap rep between copies by a reference count that the inline Ref()
// increments in our (instrumented) code but that UnrefNonInlined() decrements, and deletes at
// zero, inside libabsl_status.so, where TSan cannot see the acq_rel decrement. Without this every
// Status handed to another thread (gRPC's completion threads do it constantly) reports the delete
// racing with the construction. Each unref releases on the rep and acquires it, so the last one
// (the one that deletes) has seen every earlier owner's accesses, as the real atomics guarantee.
void Status::UnrefNonInlined(uintptr_t rep) {
  WB_REAL(void (*)(uintptr_t), "_ZN4absl7debian36Status15UnrefNonInlinedEm");
  void* addr = reinterpret_cast<void*>(rep);
  __tsan_release(addr);
  __tsan_acquire(addr);
  real(rep);
}

ABSL_NAMESPACE_END
}  // namespace absl

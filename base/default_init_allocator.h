#pragma once
// An allocator whose value-less construct() default-initialises: std::vector<uint8_t,
// DefaultInitAllocator<uint8_t>>(n) / resize(n) leave the bytes as allocated instead of zeroing them.
//
// Why: a large buffer of which only a part is ever written (a delta landing slot holds a stream of
// a few percent of its bound) should not touch every page up front: fresh pages then cost a fault
// only where they are written (seconds per GB of first touch on some VMs), and unwritten ones take
// no memory. Callers must write what they read.

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace wb {

template <typename T, typename A = std::allocator<T>>
class DefaultInitAllocator : public A {
  using Traits = std::allocator_traits<A>;

 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename Traits::template rebind_alloc<U>>;
  };
  using A::A;

  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    Traits::construct(static_cast<A&>(*this), p, std::forward<Args>(args)...);
  }
};

// Bytes that are not zeroed on allocation or growth.
template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace wb

#include "daemon/device_staging.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Hand-written fake allocator: host memory standing in for device memory (the pool never touches
// the bytes), refusing past `capacity` per device like a full GPU, and counting live allocations.
class FakeAllocator : public transport::DeviceAllocator {
 public:
  explicit FakeAllocator(int64_t capacity) : capacity_(capacity) {}
  absl::StatusOr<std::unique_ptr<transport::DeviceMemory>> Allocate(int device, int64_t size, absl::string_view label) override {
    if (device < 0 || device > 1) return absl::InvalidArgumentError(absl::StrCat(label, ": bad device ", device));
    if (in_use_[device] + size > capacity_) return absl::ResourceExhaustedError(absl::StrCat(label, ": out of memory"));
    in_use_[device] += size;
    return std::unique_ptr<transport::DeviceMemory>(new Mem(this, device, size));
  }
  int64_t in_use(int device) const { return in_use_[device]; }

 private:
  class Mem : public transport::DeviceMemory {
   public:
    Mem(FakeAllocator* a, int device, int64_t size) : a_(a), device_(device), bytes_(static_cast<size_t>(size)) {}
    ~Mem() override { a_->in_use_[device_] -= static_cast<int64_t>(bytes_.size()); }
    void* data() const override { return const_cast<char*>(bytes_.data()); }
    int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }
    int device() const override { return device_; }

   private:
    FakeAllocator* a_;
    int device_;
    std::vector<char> bytes_;
  };
  int64_t capacity_;
  int64_t in_use_[2] = {0, 0};
};

TEST(DeviceStagingTest, OffWithoutAllocatorOrBudget) {
  DeviceStaging none(nullptr, 1 << 20);
  EXPECT_FALSE(none.enabled());
  auto m = none.TryAllocate(0, 100, "x");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(*m, nullptr);
  auto alloc = std::make_shared<FakeAllocator>(1 << 20);
  DeviceStaging zero(alloc, 0);
  EXPECT_FALSE(zero.enabled());
  m = zero.TryAllocate(0, 100, "x");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(*m, nullptr);
  EXPECT_EQ(alloc->in_use(0), 0);
}

TEST(DeviceStagingTest, BudgetPerGpuAndReleaseOnDestruction) {
  auto alloc = std::make_shared<FakeAllocator>(1 << 20);
  DeviceStaging pool(alloc, 1000);
  auto a = pool.TryAllocate(0, 600, "a");
  ASSERT_TRUE(a.ok());
  ASSERT_NE(*a, nullptr);
  EXPECT_EQ((*a)->size(), 600);
  EXPECT_EQ(pool.used(0), 600);
  // Over the budget of GPU 0: fall back (nullptr), nothing allocated.
  auto b = pool.TryAllocate(0, 500, "b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, nullptr);
  EXPECT_EQ(alloc->in_use(0), 600);
  // GPU 1 has its own budget.
  auto c = pool.TryAllocate(1, 900, "c");
  ASSERT_TRUE(c.ok());
  ASSERT_NE(*c, nullptr);
  EXPECT_EQ(pool.used(1), 900);
  a->reset();
  EXPECT_EQ(pool.used(0), 0);
  EXPECT_EQ(alloc->in_use(0), 0);
  auto d = pool.TryAllocate(0, 1000, "d");
  ASSERT_TRUE(d.ok());
  EXPECT_NE(*d, nullptr);
}

TEST(DeviceStagingTest, DeviceOutOfMemoryFallsBackOtherErrorsReturn) {
  auto alloc = std::make_shared<FakeAllocator>(100);
  DeviceStaging pool(alloc, 1 << 20);
  auto a = pool.TryAllocate(0, 200, "a");  // within budget, but the device is full
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, nullptr);
  EXPECT_EQ(pool.used(0), 0);  // the reservation was given back
  auto bad = pool.TryAllocate(7, 10, "bad");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.used(7), 0);
}

TEST(DeviceStagingTest, AllocationOutlivesPool) {
  auto alloc = std::make_shared<FakeAllocator>(1 << 20);
  std::shared_ptr<transport::DeviceMemory> kept;
  {
    DeviceStaging pool(alloc, 1000);
    auto a = pool.TryAllocate(0, 10, "a");
    ASSERT_TRUE(a.ok());
    kept = *a;
  }
  EXPECT_EQ(alloc->in_use(0), 10);
  kept.reset();
  EXPECT_EQ(alloc->in_use(0), 0);
}

}  // namespace
}  // namespace wb::daemon

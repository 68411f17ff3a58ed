#pragma once
// The physical limit the GPU-direct bench compares against: an in-process cudaMemcpy device to
// device of `bytes` on GPU 0 (median of `reps`), in GB/s of bytes copied. Built against CUDA when
// @local_cuda has it (gpu_limit_cuda.cc), else gpu_limit_none.cc. Returns 0 and sets *why when it
// cannot measure (no GPU visible, built without CUDA).

#include <cstdint>
#include <string>

namespace wb::bench {

double DeviceToDeviceGBps(int64_t bytes, int reps, std::string* why);

}  // namespace wb::bench

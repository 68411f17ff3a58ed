#pragma once
// GPU part of //bench:transport: CUDA IPC copy between two processes on one GPU vs an in-process
// cudaMemcpy D2D of the same bytes. Built against CUDA when @local_cuda found it
// (transport_gpu_cuda.cc), else transport_gpu_none.cc reports the figures as not measured.

#include <cstdint>

#include <nlohmann/json.hpp>

namespace wb::transport {

// Figures to merge into the bench's JSON: ipc_copy_GBps, ipc_write_GBps, cuda_d2d_GBps,
// ipc_vs_d2d, gpu_bytes, gpu_name; or {"gpu_skipped": "<why>"} when no GPU is visible / built
// without CUDA. Spawns `self_exe --gpu_child --gpu_bytes=N` as the exporting process.
nlohmann::json MeasureGpu(const char* self_exe, int64_t bytes, int reps);

// The exporting process: allocates `bytes` on GPU 0, exports it through cuda_ipc, prints the hex
// descriptor on one stdout line and exits when stdin closes or reads a line. Returns the exit code.
int RunGpuChild(int64_t bytes);

}  // namespace wb::transport

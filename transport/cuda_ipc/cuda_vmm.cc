#include "transport/cuda_ipc/cuda_vmm.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "transport/cuda_ipc/cuda_status.h"

namespace wb::transport {
namespace {

template <typename Fn>
bool Load(const char* name, Fn* out, std::string* missing) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    if (!missing->empty()) missing->append(", ");
    missing->append(name);
    return false;
  }
  *out = reinterpret_cast<Fn>(fn);
  return true;
}

}  // namespace

#define RETURN_IF_CU(expr, what)                                        \
  do {                                                                  \
    if (absl::Status s_ = CuStatus((expr), (what)); !s_.ok()) return s_; \
  } while (0)

absl::StatusOr<const CudaVmmApi*> LoadCudaVmmApi() {
  static const absl::StatusOr<const CudaVmmApi*> api = []() -> absl::StatusOr<const CudaVmmApi*> {
    auto* a = new CudaVmmApi();  // leaked: lives as long as the process
    std::string missing;
    Load("cuMemGetAllocationGranularity", &a->granularity, &missing);
    Load("cuMemCreate", &a->create, &missing);
    Load("cuMemRelease", &a->release, &missing);
    Load("cuMemAddressReserve", &a->reserve, &missing);
    Load("cuMemAddressFree", &a->address_free, &missing);
    Load("cuMemMap", &a->map, &missing);
    Load("cuMemUnmap", &a->unmap, &missing);
    Load("cuMemSetAccess", &a->set_access, &missing);
    Load("cuMemExportToShareableHandle", &a->export_handle, &missing);
    Load("cuMemImportFromShareableHandle", &a->import_handle, &missing);
    Load("cuMemGetAllocationPropertiesFromHandle", &a->properties, &missing);
    if (!missing.empty()) {
      delete a;
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA VMM: the driver does not provide ", missing, " (cudaGetDriverEntryPointByVersion, 12.0 ABI)"));
    }
    return a;
  }();
  return api;
}

absl::Status CuStatus(CUresult r, absl::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": CUresult ", static_cast<int>(r));
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
      return absl::InvalidArgumentError(msg);
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(msg);
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::StatusOr<std::unique_ptr<VmmAllocation>> VmmAllocation::Create(int device, int64_t min_bytes, int allocations) {
  if (min_bytes <= 0 || device < 0 || allocations < 1 || allocations > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("VmmAllocation: bad size ", min_bytes, ", device ", device, " or allocation count ",
                                                   allocations));
  }
  auto api = LoadCudaVmmApi();
  if (!api.ok()) return api.status();
  WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "VmmAllocation: cudaSetDevice");
  // On error the destructor undoes what was done (mapped_ / handles_ / va_ say how far it got).
  std::unique_ptr<VmmAllocation> a(new VmmAllocation());
  a->api_ = *api;
  a->device_ = device;
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  RETURN_IF_CU((*api)->granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
  const size_t each_min = (static_cast<size_t>(min_bytes) + allocations - 1) / allocations;
  const size_t each = (each_min + g - 1) / g * g;
  const size_t size = each * static_cast<size_t>(allocations);
  for (int i = 0; i < allocations; ++i) {
    CUmemGenericAllocationHandle h = 0;
    RETURN_IF_CU((*api)->create(&h, each, &prop, 0), absl::StrCat("cuMemCreate(", each, " bytes, device ", device, ")"));
    a->handles_.push_back(h);
  }
  RETURN_IF_CU((*api)->reserve(&a->va_, size, 0, 0, 0), "cuMemAddressReserve");
  a->size_ = static_cast<int64_t>(size);
  for (int i = 0; i < allocations; ++i) {
    RETURN_IF_CU((*api)->map(a->va_ + i * each, each, 0, a->handles_[i], 0), absl::StrCat("cuMemMap of allocation ", i));
    a->mapped_ = i + 1;
  }
  CUmemAccessDesc rw = {};
  rw.location = prop.location;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  RETURN_IF_CU((*api)->set_access(a->va_, size, &rw, 1), "cuMemSetAccess");
  return a;
}

VmmAllocation::~VmmAllocation() {
  if (api_ == nullptr) return;
  const size_t each = static_cast<size_t>(allocation_bytes());
  for (int i = 0; i < mapped_; ++i) (void)api_->unmap(va_ + i * each, each);
  if (va_ != 0) (void)api_->address_free(va_, static_cast<size_t>(size_));
  for (CUmemGenericAllocationHandle h : handles_) (void)api_->release(h);
}

absl::StatusOr<int> VmmAllocation::ExportFd(int i) const {
  if (i < 0 || i >= allocations()) {
    return absl::InvalidArgumentError(absl::StrCat("VmmAllocation::ExportFd: no allocation ", i, " (", allocations(), " in all)"));
  }
  int fd = -1;
  if (absl::Status s = CuStatus(api_->export_handle(&fd, handles_[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                                "cuMemExportToShareableHandle(POSIX fd)");
      !s.ok()) {
    return s;
  }
  return fd;
}

}  // namespace wb::transport

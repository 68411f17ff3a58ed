#include "transport/cuda_ipc/cuda_status.h"

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(CudaStatusTest, MapsCodesAndNamesTheCall) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
  absl::Status s = CudaStatus(cudaErrorInvalidValue, "cudaMemcpyAsync op 3");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cudaMemcpyAsync op 3"), std::string::npos);
  EXPECT_NE(s.message().find("cudaErrorInvalidValue"), std::string::npos) << s;
  EXPECT_NE(CudaStatus(cudaErrorIllegalAddress, "k").message().find("sticky"), std::string::npos);
}

#if __has_include(<nccl.h>)
TEST(CudaStatusTest, MapsNcclCodes) {
  EXPECT_TRUE(NcclStatus(ncclSuccess, "x").ok());
  EXPECT_EQ(NcclStatus(ncclRemoteError, "ncclSend").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(NcclStatus(ncclInvalidUsage, "ncclGroupEnd").code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = NcclStatus(ncclInternalError, "ncclCommInitRankConfig peer abc");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("peer abc"), std::string::npos) << s;
}
#endif

}  // namespace
}  // namespace wb::transport

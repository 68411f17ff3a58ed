#include "transport/cuda_status.h"

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

}  // namespace
}  // namespace wb::transport

#include "base/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace wb {
namespace {

absl::StatusOr<int> ParsePositive(int x) {
  if (x <= 0) return absl::InvalidArgumentError(absl::StrCat("not positive: ", x));
  return x;
}

absl::StatusOr<int> Doubled(int x) {
  ASSIGN_OR_RETURN(int v, ParsePositive(x));
  return 2 * v;
}

absl::Status Check(int x) {
  RETURN_IF_ERROR(ParsePositive(x));
  RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

absl::Status CheckWithContext(int x) {
  RETURN_IF_ERROR_WITH(ParsePositive(x), absl::StrCat("tensor ", "w"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<std::string>> MoveOnly(bool fail) {
  if (fail) return absl::NotFoundError("none");
  return std::make_unique<std::string>("hi");
}

absl::StatusOr<std::string> UseMoveOnly(bool fail) {
  ASSIGN_OR_RETURN(std::unique_ptr<std::string> p, MoveOnly(fail));
  ASSIGN_OR_RETURN(auto q, MoveOnly(fail));
  return *p + *q;
}

TEST(StatusMacros, AssignOrReturnPropagates) {
  EXPECT_EQ(*Doubled(3), 6);
  absl::StatusOr<int> bad = Doubled(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "not positive: -1");
}

TEST(StatusMacros, ReturnIfError) {
  EXPECT_TRUE(Check(1).ok());
  EXPECT_EQ(Check(0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusMacros, ContextIsPrepended) {
  absl::Status s = CheckWithContext(-2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tensor w: not positive: -2");
  EXPECT_TRUE(CheckWithContext(2).ok());
}

TEST(StatusMacros, MoveOnlyValues) {
  EXPECT_EQ(*UseMoveOnly(false), "hihi");
  EXPECT_EQ(UseMoveOnly(true).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace wb

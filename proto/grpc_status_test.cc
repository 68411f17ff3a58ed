#include "proto/grpc_status.h"

#include "gtest/gtest.h"
#include "proto/weightbridge.pb.h"

namespace wb {
namespace {

TEST(GrpcStatus, RoundTripsEveryCode) {
  for (int c = 0; c <= 16; ++c) {
    absl::Status s(static_cast<absl::StatusCode>(c), c == 0 ? "" : "why");
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    absl::Status back = FromGrpcStatus(g);
    EXPECT_EQ(back.code(), s.code());
    if (c != 0) {
      EXPECT_EQ(back.message(), "why");
    }
  }
}

TEST(GrpcStatus, NamedCodesMatch) {
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("bad box")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("late")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no token")).code(),
            absl::StatusCode::kUnauthenticated);
}

// Issue 15.12: an echoed 1 MiB value must not push the status past gRPC's metadata limit.
TEST(GrpcStatus, LongMessagesAreCappedKeepingHeadAndTail) {
  const std::string what = "worker w: tensor '";
  const std::string why = "' is not in the model";
  grpc::Status g = ToGrpcStatus(absl::InvalidArgumentError(what + std::string(1 << 20, 'x') + why));
  EXPECT_LE(g.error_message().size(), kMaxEncodedStatusMessage + 64);
  EXPECT_EQ(g.error_message().rfind(what, 0), 0u) << g.error_message().substr(0, 100);
  EXPECT_EQ(g.error_message().substr(g.error_message().size() - why.size()), why);
  EXPECT_NE(g.error_message().find("bytes of this message cut"), std::string::npos);
  // Bytes that travel percent-encoded count three times.
  g = ToGrpcStatus(absl::InvalidArgumentError(std::string(4000, '\n')));
  EXPECT_LE(g.error_message().size(), kMaxEncodedStatusMessage / 3 + 64);
  // Short messages are untouched.
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("no model m")).error_message(), "no model m");
}

TEST(Protos, MessagesSerialize) {
  weightbridge::v1::Piece p;
  p.set_tensor("model.layers.0.self_attn.q_proj.weight");
  p.mutable_box()->add_begin(0);
  p.mutable_box()->add_end(128);
  p.set_offset_bytes(4096);
  std::string bytes;
  ASSERT_TRUE(p.SerializeToString(&bytes));
  weightbridge::v1::Piece q;
  ASSERT_TRUE(q.ParseFromString(bytes));
  EXPECT_EQ(q.tensor(), p.tensor());
  EXPECT_EQ(q.box().end(0), 128);
  EXPECT_EQ(q.offset_bytes(), 4096u);
}

}  // namespace
}  // namespace wb

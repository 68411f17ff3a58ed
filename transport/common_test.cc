#include "transport/common.h"

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(PlainDescriptorTest, RoundTrip) {
  const std::string bytes = EncodePlainDescriptor("kindx", {"inst1", "node1", 42, 4096, "buffer 0"});
  auto d = DecodePlainDescriptor("kindx", bytes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->instance, "inst1");
  EXPECT_EQ(d->node, "node1");
  EXPECT_EQ(d->region_id, 42u);
  EXPECT_EQ(d->size, 4096);
  EXPECT_EQ(d->label, "buffer 0");
}

TEST(PlainDescriptorTest, HeaderIsTheSharedRecordHeader) {
  const std::string bytes = EncodePlainDescriptor("kindx", {"i", "n", 1, 2, "l"});
  wire::Writer w = RecordWriter(RecordType::kDescriptor, "kindx", "i", "n");
  ASSERT_GE(bytes.size(), w.out().size());
  EXPECT_EQ(bytes.substr(0, w.out().size()), w.out());
}

TEST(PlainDescriptorTest, RejectsGarbageOtherKindsNegativeSizeAndEndpoints) {
  auto garbage = DecodePlainDescriptor("kindx", "not a descriptor");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(garbage.status().message(), "kindx ImportDescriptor: bytes are not a transport descriptor");
  auto other = DecodePlainDescriptor("kindx", EncodePlainDescriptor("kindy", {"i", "n", 1, 2, "l"}));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other.status().message(), "kindx ImportDescriptor: descriptor is for 'kindy'");
  auto negative = DecodePlainDescriptor("kindx", EncodePlainDescriptor("kindx", {"i", "n", 1, -1, "l"}));
  EXPECT_EQ(negative.status().message(), "kindx ImportDescriptor: negative size");
  wire::Writer endpoint = RecordWriter(RecordType::kEndpoint, "kindx", "i", "n");
  endpoint.U64(1);
  endpoint.I64(2);
  endpoint.Str("l");
  EXPECT_EQ(DecodePlainDescriptor("kindx", endpoint.out()).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string good = EncodePlainDescriptor("kindx", {"i", "n", 1, 2, "l"});
  EXPECT_FALSE(DecodePlainDescriptor("kindx", good.substr(0, good.size() - 1)).ok());  // truncated
  EXPECT_FALSE(DecodePlainDescriptor("kindx", good + "x").ok());                        // trailing bytes
}

}  // namespace
}  // namespace wb::transport

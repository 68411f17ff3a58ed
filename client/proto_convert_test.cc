#include "client/proto_convert.h"

#include "gtest/gtest.h"

namespace wb::client {
namespace {

planner::Inventory TwoTensors() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {4, 6}, planner::DType::kBF16});
  inv.tensors.push_back({"b", {10}, planner::DType::kF32});
  return inv;
}

TEST(ProtoConvertTest, PieceRoundTripsThroughTensorNames) {
  planner::Inventory inv = TwoTensors();
  planner::Piece p;
  p.tensor = 1;
  p.box = {{2}, {7}};
  p.buffer = 3;
  p.offset_bytes = 40;
  p.strides = {1};
  auto proto = PieceToProto(p, inv);
  ASSERT_TRUE(proto.ok()) << proto.status();
  EXPECT_EQ(proto->tensor(), "b");
  auto back = PieceFromProto(*proto, inv);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tensor, 1);
  EXPECT_EQ(back->box.begin, std::vector<int64_t>{2});
  EXPECT_EQ(back->box.end, std::vector<int64_t>{7});
  EXPECT_EQ(back->buffer, 3);
  EXPECT_EQ(back->offset_bytes, 40);
}

TEST(ProtoConvertTest, UnknownTensorAndBadBoxAreNamed) {
  planner::Inventory inv = TwoTensors();
  pb::Piece p;
  p.set_tensor("model.nope.weight");
  auto r = PieceFromProto(p, inv);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("model.nope.weight"), absl::string_view::npos);
  p.set_tensor("a");
  p.mutable_box()->add_begin(0);
  EXPECT_FALSE(PieceFromProto(p, inv).ok());  // 1 begin, 0 end
  planner::Piece bad;
  bad.tensor = 5;
  EXPECT_FALSE(PieceToProto(bad, inv).ok());
}

TEST(ProtoConvertTest, EnumsRoundTrip) {
  for (auto d : {planner::DType::kBF16, planner::DType::kF16, planner::DType::kF32,
                 planner::DType::kF8E4M3, planner::DType::kI64}) {
    EXPECT_EQ(*FromProto(ToProto(d)), d);
  }
  for (auto m : {Mode::kSync, Mode::kOneStepOff, Mode::kAsync}) {
    EXPECT_EQ(*FromProto(ToProto(m)), m);
    EXPECT_EQ(*ParseMode(ModeName(m)), m);
  }
  EXPECT_EQ(*FromProto(ToProto(planner::Strategy::kRank0Broadcast)),
            planner::Strategy::kRank0Broadcast);
  EXPECT_FALSE(ParseMode("lockstep").ok());
  EXPECT_FALSE(ParseStrategy("owner_broadcast").ok());
  EXPECT_FALSE(FromProto(pb::MODE_UNSPECIFIED).ok());
}

TEST(ProtoConvertTest, InventoryRoundTrips) {
  auto inv = FromProto(ToProto(TwoTensors()));
  ASSERT_TRUE(inv.ok());
  ASSERT_EQ(inv->tensors.size(), 2u);
  EXPECT_EQ(inv->tensors[1].name, "b");
  EXPECT_EQ(inv->tensors[1].dtype, planner::DType::kF32);
  EXPECT_EQ(inv->tensors[0].shape, (std::vector<int64_t>{4, 6}));
}

}  // namespace
}  // namespace wb::client

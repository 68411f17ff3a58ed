// The one proto <-> planner conversion library (proto/convert.h): round trips, and every rule of
// the header's contract failing with an error that names what is wrong. Merged from the daemon's
// and the client's converter tests (client/proto_convert_test.cc).
#include "proto/convert.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace wb::convert {
namespace {

using ::testing::HasSubstr;

planner::Inventory TwoTensors() {
  planner::Inventory inv;
  inv.tensors.push_back({"a", {4, 6}, planner::DType::kBF16});
  inv.tensors.push_back({"b", {10}, planner::DType::kF32});
  return inv;
}

// A resolved layout: buffers 7 and 9; a piece of "a" in buffer 9, a quantised piece of "b".
pb::ResolvedLayout TwoPieceLayout() {
  pb::ResolvedLayout l;
  pb::BufferSpec* b0 = l.add_buffers();
  b0->set_buffer_id(7);
  b0->set_size_bytes(1000);
  pb::BufferSpec* b1 = l.add_buffers();
  b1->set_buffer_id(9);
  b1->set_size_bytes(2000);
  pb::Piece* p = l.add_pieces();
  p->set_tensor("a");
  ToProto(planner::Box{{0, 0}, {4, 6}}, p->mutable_box());
  p->set_buffer_id(9);
  p->set_offset_bytes(256);
  p->add_strides(6);
  p->add_strides(1);
  pb::Piece* q = l.add_pieces();
  q->set_tensor("b");
  ToProto(planner::Box{{0}, {10}}, q->mutable_box());
  q->set_buffer_id(7);
  q->add_strides(1);
  q->set_quant_dtype(pb::DTYPE_F8_E4M3);
  q->add_quant_block(128);
  q->set_scale_buffer_id(9);
  q->set_scale_offset_bytes(64);
  return l;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(ConvertTest, PieceRoundTripsThroughTensorNames) {
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
  EXPECT_EQ(proto->buffer_id(), 3u);  // a worker's own pieces: id == index
  auto back = PieceFromProto(*proto, inv);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tensor, 1);
  EXPECT_EQ(back->box.begin, std::vector<int64_t>{2});
  EXPECT_EQ(back->box.end, std::vector<int64_t>{7});
  EXPECT_EQ(back->buffer, 3);
  EXPECT_EQ(back->offset_bytes, 40);
}

TEST(ConvertTest, PieceErrorsNameTheTensorAndWhatIsWrong) {
  planner::Inventory inv = TwoTensors();
  pb::Piece p;
  p.set_tensor("model.nope.weight");
  auto r = PieceFromProto(p, inv);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(r.status()), HasSubstr("model.nope.weight"));
  p.set_tensor("a");
  p.mutable_box()->add_begin(0);  // 1 begin, 0 end
  EXPECT_THAT(Message(PieceFromProto(p, inv).status()), HasSubstr("1 begin and 0 end"));
  p.mutable_box()->add_end(4);  // rank 1, tensor a has rank 2
  p.add_strides(1);
  EXPECT_THAT(Message(PieceFromProto(p, inv).status()), HasSubstr("rank must be 2"));
  planner::Piece bad;
  bad.tensor = 5;
  EXPECT_THAT(Message(PieceToProto(bad, inv).status()), HasSubstr("tensor index 5"));
  bad.tensor = 0;
  bad.offset_bytes = -1;
  EXPECT_THAT(Message(PieceToProto(bad, inv).status()), HasSubstr("negative"));
}

TEST(ConvertTest, LayoutMapsBufferIdsBothWays) {
  planner::Inventory inv = TwoTensors();
  pb::ResolvedLayout proto = TwoPieceLayout();
  auto layout = LayoutFromProto(proto, inv);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->buffers.size(), 2u);
  EXPECT_EQ(layout->buffers[1].size_bytes, 2000);
  ASSERT_EQ(layout->pieces.size(), 2u);
  EXPECT_EQ(layout->pieces[0].buffer, 1);  // id 9 is the second buffer
  EXPECT_EQ(layout->pieces[0].offset_bytes, 256);
  ASSERT_TRUE(layout->pieces[1].quant.has_value());
  EXPECT_EQ(layout->pieces[1].quant->dtype, planner::DType::kF8E4M3);
  EXPECT_EQ(layout->pieces[1].quant->scale_buffer, 1);
  EXPECT_EQ(layout->pieces[1].quant->scale_offset_bytes, 64);

  pb::ResolvedLayout again;
  LayoutToProto(*layout, inv, proto.buffers(), &again);
  ASSERT_EQ(again.pieces_size(), 2);
  EXPECT_EQ(again.pieces(0).buffer_id(), 9u);
  EXPECT_EQ(again.pieces(1).buffer_id(), 7u);
  EXPECT_EQ(again.pieces(1).scale_buffer_id(), 9u);
  EXPECT_EQ(again.pieces(1).quant_block(0), 128);
  auto round = LayoutFromProto(again, inv);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(round->pieces[0].strides, (std::vector<int64_t>{6, 1}));
  EXPECT_FALSE(again.pieces(1).has_quant_global_scale_offset());  // unset unless NVFP4
  EXPECT_EQ(round->pieces[1].quant->global_scale_offset_bytes, -1);

  // NVFP4: the global scale's offset survives both ways, including 0.
  proto.mutable_pieces(1)->set_quant_dtype(pb::DTYPE_F4_E2M1);
  proto.mutable_pieces(1)->set_quant_scale_dtype(pb::DTYPE_F8_E4M3);
  proto.mutable_pieces(1)->set_quant_global_scale_offset(0);
  auto nv = LayoutFromProto(proto, inv);
  ASSERT_TRUE(nv.ok()) << nv.status();
  EXPECT_EQ(nv->pieces[1].quant->dtype, planner::DType::kF4E2M1);
  EXPECT_EQ(nv->pieces[1].quant->global_scale_offset_bytes, 0);
  pb::ResolvedLayout nv_again;
  LayoutToProto(*nv, inv, proto.buffers(), &nv_again);
  ASSERT_TRUE(nv_again.pieces(1).has_quant_global_scale_offset());
  EXPECT_EQ(nv_again.pieces(1).quant_global_scale_offset(), 0u);
  EXPECT_EQ(nv_again.pieces(1).quant_dtype(), pb::DTYPE_F4_E2M1);
}

TEST(ConvertTest, LayoutErrorsNameThePiece) {
  planner::Inventory inv = TwoTensors();
  struct Case {
    const char* what;
    void (*mutate)(pb::ResolvedLayout*);
    const char* want;
  };
  const Case cases[] = {
      {"unknown tensor", [](pb::ResolvedLayout* l) { l->mutable_pieces(1)->set_tensor("zzz"); }, "piece 1: unknown tensor 'zzz'"},
      {"unknown buffer", [](pb::ResolvedLayout* l) { l->mutable_pieces(0)->set_buffer_id(8); }, "piece 0 of tensor a: unknown buffer_id 8"},
      {"unknown scale buffer", [](pb::ResolvedLayout* l) { l->mutable_pieces(1)->set_scale_buffer_id(3); },
       "piece 1 of tensor b: unknown scale_buffer_id 3"},
      {"duplicate buffer id", [](pb::ResolvedLayout* l) { l->mutable_buffers(1)->set_buffer_id(7); }, "duplicate buffer_id 7"},
      {"strides rank", [](pb::ResolvedLayout* l) { l->mutable_pieces(0)->clear_strides(); }, "piece 0 of tensor a: box/strides rank must be 2"},
      {"block without dtype", [](pb::ResolvedLayout* l) { l->mutable_pieces(1)->set_quant_dtype(pb::DTYPE_UNSPECIFIED); },
       "piece 1 of tensor b: quant_block without quant_dtype"},
      {"bad quant dtype", [](pb::ResolvedLayout* l) { l->mutable_pieces(1)->set_quant_dtype(static_cast<pb::DType>(99)); },
       "piece 1 of tensor b: quant_dtype: unknown dtype enum value 99"},
      {"huge offset", [](pb::ResolvedLayout* l) { l->mutable_pieces(0)->set_offset_bytes(~0ull); }, "offset_bytes 18446744073709551615 too large"},
      {"global scale without dtype", [](pb::ResolvedLayout* l) { l->mutable_pieces(0)->set_quant_global_scale_offset(8); },
       "piece 0 of tensor a: quant_global_scale_offset without quant_dtype"},
      {"huge global scale offset", [](pb::ResolvedLayout* l) { l->mutable_pieces(1)->set_quant_global_scale_offset(~0ull); },
       "piece 1 of tensor b: quant_global_scale_offset 18446744073709551615 too large"},
  };
  for (const Case& c : cases) {
    pb::ResolvedLayout l = TwoPieceLayout();
    c.mutate(&l);
    auto r = LayoutFromProto(l, inv);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(Message(r.status()), HasSubstr(c.want)) << c.what;
  }
}

TEST(ConvertTest, EnumsRoundTripAndUnknownValuesAreErrors) {
  for (auto d : {planner::DType::kBF16, planner::DType::kF16, planner::DType::kF32, planner::DType::kF8E4M3,
                 planner::DType::kI64, planner::DType::kE8M0, planner::DType::kI4, planner::DType::kF4E2M1}) {
    EXPECT_EQ(*FromProto(ToProto(d)), d);
  }
  for (auto m : {Mode::kSync, Mode::kOneStepOff, Mode::kAsync}) {
    EXPECT_EQ(*FromProto(ToProto(m)), m);
    EXPECT_EQ(*ParseMode(ModeName(m)), m);
    EXPECT_STREQ(ModeName(ToProto(m)), ModeName(m));
  }
  for (auto r : {planner::Role::kTrainer, planner::Role::kRollout}) EXPECT_EQ(*FromProto(ToProto(r)), r);
  for (auto s : {planner::Strategy::kWeightBridge, planner::Strategy::kRank0Broadcast, planner::Strategy::kP2PNoDedup}) {
    EXPECT_EQ(*FromProto(ToProto(s)), s);
  }
  // UNSPECIFIED: the proto's documented default where it has one, an error where it has none.
  EXPECT_EQ(*FromProto(pb::DTYPE_UNSPECIFIED), planner::DType::kBF16);
  EXPECT_EQ(*FromProto(pb::STRATEGY_UNSPECIFIED), planner::Strategy::kWeightBridge);
  EXPECT_THAT(Message(FromProto(pb::ROLE_UNSPECIFIED).status()), HasSubstr("role must be trainer or rollout"));
  EXPECT_FALSE(FromProto(pb::MODE_UNSPECIFIED).ok());
  EXPECT_STREQ(ModeName(pb::MODE_UNSPECIFIED), "sync");
  // Values the proto does not define.
  EXPECT_THAT(Message(FromProto(static_cast<pb::DType>(42)).status()), HasSubstr("42"));
  EXPECT_FALSE(FromProto(static_cast<pb::Strategy>(42)).ok());
  EXPECT_EQ(ToProto(planner::Strategy::kOwnerBroadcast), pb::STRATEGY_UNSPECIFIED);
  EXPECT_FALSE(ParseMode("lockstep").ok());
  EXPECT_FALSE(ParseStrategy("owner_broadcast").ok());
  EXPECT_EQ(ToProto(planner::Route::kInterNode), pb::ROUTE_INTER_NODE);
}

TEST(ConvertTest, InventoryRoundTripsAndNamesBadTensors) {
  auto inv = FromProto(ToProto(TwoTensors()));
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_EQ(inv->tensors.size(), 2u);
  EXPECT_EQ(inv->tensors[1].name, "b");
  EXPECT_EQ(inv->tensors[1].dtype, planner::DType::kF32);
  EXPECT_EQ(inv->tensors[0].shape, (std::vector<int64_t>{4, 6}));

  pb::ExplicitInventory bad = ToProto(TwoTensors());
  bad.mutable_tensors(1)->set_name("a");
  EXPECT_THAT(Message(FromProto(bad).status()), HasSubstr("duplicate tensor a"));
  bad = ToProto(TwoTensors());
  bad.mutable_tensors(0)->set_shape(1, 0);
  EXPECT_THAT(Message(FromProto(bad).status()), HasSubstr("tensor a: dimension 1 is 0"));
  bad = ToProto(TwoTensors());
  bad.mutable_tensors(0)->clear_name();
  EXPECT_THAT(Message(FromProto(bad).status()), HasSubstr("empty name"));
  bad = ToProto(TwoTensors());
  bad.mutable_tensors(1)->set_dtype(static_cast<pb::DType>(77));
  EXPECT_THAT(Message(FromProto(bad).status()), HasSubstr("tensor b: unknown dtype enum value 77"));
}

TEST(ConvertTest, ParallelConfigDefaults) {
  pb::ParallelConfig p;
  p.set_preset("megatron");
  p.set_tp(4);
  p.set_vpp(2);
  absl::StatusOr<planner::ParallelConfig> c = ParallelFromProto(p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->preset, "megatron");
  EXPECT_EQ(c->tp, 4);
  EXPECT_EQ(c->pp, 1);
  EXPECT_EQ(c->dp, 1);
  EXPECT_EQ(c->ep, 1);
  EXPECT_EQ(c->etp, 0);  // 0 = tp
  EXPECT_EQ(c->replicas, 1);
  EXPECT_EQ(c->vpp, 2);
  EXPECT_EQ(c->vocab_divisible_by, 128);
  EXPECT_FALSE(c->enable_dp_lm_head);
  EXPECT_EQ(c->moe_dense_tp_size, 0);  // not set
}

// Every count over the largest preset world is refused naming the field and the value sent.
// Before (hostile probe): dp = 2^31 was refused as "dp=-2147483648", replicas = 2^32 - 1 as
// "replicas=-1", vpp = 2^31 as "vpp=1073741824", and make_vocab_size_divisible_by = 2^32 - 1 was
// taken as 2^20 (a layout with 2^20-row vocab padding the worker never asked for).
TEST(ConvertTest, ParallelConfigCountsOverTheWorldLimitAreRefusedNamingTheValue) {
  using Setter = void (pb::ParallelConfig::*)(uint32_t);
  const std::pair<const char*, Setter> fields[] = {
      {"tp", &pb::ParallelConfig::set_tp},
      {"pp", &pb::ParallelConfig::set_pp},
      {"dp", &pb::ParallelConfig::set_dp},
      {"ep", &pb::ParallelConfig::set_ep},
      {"etp", &pb::ParallelConfig::set_etp},
      {"replicas", &pb::ParallelConfig::set_replicas},
      {"rank", &pb::ParallelConfig::set_rank},
      {"first_stage_layers", &pb::ParallelConfig::set_first_stage_layers},
      {"last_stage_layers", &pb::ParallelConfig::set_last_stage_layers},
      {"vpp", &pb::ParallelConfig::set_vpp},
      {"make_vocab_size_divisible_by", &pb::ParallelConfig::set_make_vocab_size_divisible_by},
      {"moe_dense_tp_size", &pb::ParallelConfig::set_moe_dense_tp_size},
  };
  for (const auto& [name, set] : fields) {
    for (uint32_t v : {(1u << 20) + 1, 1u << 31, ~0u}) {
      pb::ParallelConfig p;
      p.set_preset("megatron");
      (p.*set)(v);
      absl::StatusOr<planner::ParallelConfig> c = ParallelFromProto(p);
      ASSERT_FALSE(c.ok()) << name << " = " << v;
      EXPECT_TRUE(absl::IsInvalidArgument(c.status()));
      EXPECT_THAT(Message(c.status()), HasSubstr(absl::StrCat("ParallelConfig.", name, " is ", v, ": more than the limit of 1048576")));
    }
    pb::ParallelConfig p;
    p.set_preset("megatron");
    (p.*set)(1u << 20);  // at the limit: taken as sent
    EXPECT_TRUE(ParallelFromProto(p).ok()) << name;
  }
  pb::ParallelConfig p;
  p.set_make_vocab_size_divisible_by(1u << 20);
  EXPECT_EQ(ParallelFromProto(p)->vocab_divisible_by, 1 << 20);
}

// SGLang's --enable-dp-lm-head and --moe-dense-tp-size reach the preset.
TEST(ConvertTest, ParallelConfigSglangServerOptions) {
  pb::ParallelConfig p;
  p.set_preset("sglang");
  p.set_tp(1);
  p.set_dp(8);
  p.set_enable_dp_lm_head(true);
  p.set_moe_dense_tp_size(1);
  absl::StatusOr<planner::ParallelConfig> c = ParallelFromProto(p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->enable_dp_lm_head);
  EXPECT_EQ(c->moe_dense_tp_size, 1);
}

TEST(ConvertTest, PlanStats) {
  planner::PlanStats s;
  s.complete = true;
  s.num_ops = 12;
  s.bytes_inter_node = 1 << 20;
  pb::PlanStats out;
  StatsToProto(s, 3, &out);
  EXPECT_TRUE(out.complete());
  EXPECT_EQ(out.num_ops(), 12u);
  EXPECT_EQ(out.bytes_inter_node(), 1u << 20);
  EXPECT_EQ(out.num_buckets(), 3u);
}

}  // namespace
}  // namespace wb::convert

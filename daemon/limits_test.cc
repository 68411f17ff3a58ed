#include "daemon/limits.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

namespace pb = ::weightbridge::v1;

pb::ModelSpec Spec(std::vector<std::vector<int64_t>> shapes) {
  pb::ModelSpec s;
  s.set_model_id("m");
  int i = 0;
  for (auto& shape : shapes) {
    pb::TensorSpec* t = s.mutable_explicit_tensors()->add_tensors();
    t->set_name("t" + std::to_string(i++));
    t->mutable_shape()->Assign(shape.begin(), shape.end());
  }
  return s;
}

struct LayoutReq {
  google::protobuf::RepeatedPtrField<pb::BufferSpec> buffers;
  pb::LayoutSpec layout;
};

LayoutReq Layout(int buffers, uint64_t size, int pieces) {
  LayoutReq r;
  for (int b = 0; b < buffers; ++b) {
    pb::BufferSpec* s = r.buffers.Add();
    s->set_buffer_id(b);
    s->set_size_bytes(size);
  }
  for (int p = 0; p < pieces; ++p) {
    pb::Piece* piece = r.layout.mutable_pieces()->add_pieces();
    piece->set_tensor("t0");
    piece->mutable_box()->add_begin(0);
    piece->mutable_box()->add_end(4);
    piece->set_buffer_id(0);
  }
  return r;
}

TEST(LimitsTest, ModelSpecWithinLimitsPasses) { EXPECT_TRUE(CheckModelSpec(Spec({{4, 8}, {3}}), Limits()).ok()); }

TEST(LimitsTest, TooManyTensorsIsResourceExhausted) {
  Limits l;
  l.max_tensors_per_model = 2;
  absl::Status s = CheckModelSpec(Spec({{1}, {1}, {1}}), l);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("3 tensors"), std::string::npos) << s;
}

TEST(LimitsTest, ShapeProductOverflowIsInvalidArgument) {
  absl::Status s = CheckModelSpec(Spec({{int64_t{1} << 40, int64_t{1} << 40}}), Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor t0"), std::string::npos) << s;
  EXPECT_EQ(CheckModelSpec(Spec({{INT64_MAX, INT64_MAX, 3}}), Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckModelSpec(Spec({{4, 0}}), Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckModelSpec(Spec({{4, -2}}), Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckModelSpec(Spec({{1, 1, 1, 1, 1, 1, 1, 1, 1}}), Limits()).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LimitsTest, DuplicateTensorAndBadIds) {
  pb::ModelSpec s = Spec({{1}, {1}});
  s.mutable_explicit_tensors()->mutable_tensors(1)->set_name("t0");
  EXPECT_EQ(CheckModelSpec(s, Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckId("worker_id", "", Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckId("worker_id", std::string(5000, 'a'), Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckId("worker_id", "a\nb", Limits()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckId("worker_id", "rollout/3", Limits()).ok());
}

TEST(LimitsTest, LayoutWithinLimitsPasses) {
  LayoutReq r = Layout(2, 1024, 3);
  EXPECT_TRUE(CheckLayoutRequest(r.buffers, r.layout, Limits()).ok());
}

TEST(LimitsTest, HugeSizeBytesIsRefusedBeforeAnyAllocation) {
  LayoutReq r = Layout(1, ~uint64_t{0}, 1);
  absl::Status s = CheckLayoutRequest(r.buffers, r.layout, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("buffer 0"), std::string::npos) << s;
}

TEST(LimitsTest, WorkerTotalBytesBoundedByBudget) {
  Limits l;
  l.max_worker_bytes = 3000;
  LayoutReq r = Layout(3, 1024, 1);
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, l).code(), absl::StatusCode::kResourceExhausted);
}

TEST(LimitsTest, CudaBuffersCountOnlyWithoutGpuStaging) {
  Limits l;
  l.max_worker_bytes = 1500;
  LayoutReq r = Layout(3, 1024, 1);
  for (int i : {1, 2}) r.buffers.Mutable(i)->set_cuda_ipc_handle(std::string(64, 'h'));
  // Host staging mirrors every buffer: 3 KiB > 1500.
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, l).code(), absl::StatusCode::kResourceExhausted);
  // GPU staging mirrors the two CUDA buffers on the GPU: only the host one counts.
  l.cuda_staged_on_gpu = true;
  EXPECT_TRUE(CheckLayoutRequest(r.buffers, r.layout, l).ok());
  r.buffers.Mutable(1)->set_shm_name("/wb-x");  // now two host buffers: 2 KiB > 1500
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, l).code(), absl::StatusCode::kResourceExhausted);
}

TEST(LimitsTest, VmmNextKeysNeedAVmmBuffer) {
  LayoutReq r = Layout(2, 1024, 1);
  r.buffers.Mutable(1)->set_cuda_vmm_key("a0");
  r.buffers.Mutable(1)->add_cuda_vmm_next_keys("a1");
  EXPECT_TRUE(CheckLayoutRequest(r.buffers, r.layout, Limits()).ok());
  r.buffers.Mutable(0)->add_cuda_vmm_next_keys("a2");  // a shm buffer
  absl::Status s = CheckLayoutRequest(r.buffers, r.layout, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("buffer 0: cuda_vmm_next_keys without cuda_vmm_key"), std::string::npos) << s;
}

TEST(LimitsTest, TooManyBuffersOrPieces) {
  Limits l;
  l.max_buffers_per_worker = 2;
  l.max_pieces_per_layout = 5;
  LayoutReq many_buffers = Layout(3, 8, 1);
  EXPECT_EQ(CheckLayoutRequest(many_buffers.buffers, many_buffers.layout, l).code(), absl::StatusCode::kResourceExhausted);
  LayoutReq many_pieces = Layout(1, 8, 6);
  absl::Status s = CheckLayoutRequest(many_pieces.buffers, many_pieces.layout, l);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("6 pieces"), std::string::npos) << s;
}

TEST(LimitsTest, MalformedPiecesAreInvalidArgument) {
  LayoutReq r = Layout(1, 64, 1);
  pb::Piece* p = r.layout.mutable_pieces()->mutable_pieces(0);
  p->mutable_box()->add_end(3);  // rank mismatch
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, Limits()).code(), absl::StatusCode::kInvalidArgument);
  r = Layout(1, 64, 1);
  p = r.layout.mutable_pieces()->mutable_pieces(0);
  p->mutable_box()->set_begin(0, 5);  // empty range
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, Limits()).code(), absl::StatusCode::kInvalidArgument);
  r = Layout(1, 64, 1);
  r.layout.mutable_pieces()->mutable_pieces(0)->set_buffer_id(9);  // unknown buffer
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, Limits()).code(), absl::StatusCode::kInvalidArgument);
  r = Layout(2, 64, 0);
  r.buffers.Mutable(1)->set_buffer_id(0);  // duplicate id
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, Limits()).code(), absl::StatusCode::kInvalidArgument);
  r = Layout(1, 64, 1);
  p = r.layout.mutable_pieces()->mutable_pieces(0);
  p->mutable_box()->set_end(0, INT64_MAX);
  p->mutable_box()->add_begin(0);
  p->mutable_box()->add_end(INT64_MAX);  // product overflows
  EXPECT_EQ(CheckLayoutRequest(r.buffers, r.layout, Limits()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wb::daemon

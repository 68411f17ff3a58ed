#include "daemon/coordinator/test_specs.h"

#include <cstdint>
#include <memory>
#include <string>

namespace wb::daemon::testing {

pb::ModelSpec SmallModelSpec(const std::string& id, int rollouts) {
  pb::ModelSpec spec;
  spec.set_model_id(id);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(static_cast<uint32_t>(rollouts));
  pb::TensorSpec* t = spec.mutable_explicit_tensors()->add_tensors();
  t->set_name("w");
  t->add_shape(4);
  t->add_shape(4);
  t->set_dtype(pb::DTYPE_BF16);
  return spec;
}

pb::SubmitLayoutRequest WholeTensorLayout(const std::string& node, const std::string& worker) {
  pb::SubmitLayoutRequest req;
  req.set_node_id(node);
  req.set_model_id("m");
  req.set_worker_id(worker);
  pb::BufferSpec* b = req.add_buffers();
  b->set_buffer_id(0);
  b->set_size_bytes(32);
  b->set_shm_name("/wb-test-" + worker);
  b->set_gpu(-1);
  pb::Piece* p = req.mutable_layout()->mutable_pieces()->add_pieces();
  p->set_tensor("w");
  for (int d = 0; d < 2; ++d) {
    p->mutable_box()->add_begin(0);
    p->mutable_box()->add_end(4);
  }
  p->set_buffer_id(0);
  p->set_offset_bytes(0);
  p->add_strides(4);
  p->add_strides(1);
  return req;
}

pb::ReportDoneRequest DoneReport(const std::string& node, const pb::ExecuteVersionRequest& req) {
  pb::ReportDoneRequest done;
  done.set_node_id(node);
  done.set_model_id(req.model_id());
  done.set_version(req.version());
  done.set_ok(true);
  done.set_coordinator_instance(req.coordinator_instance());
  return done;
}

SliceInput BigSliceInput(const std::string& model, int tensors) {
  auto inv = std::make_shared<planner::Inventory>();
  for (int i = 0; i < tensors; ++i) inv->tensors.push_back({"t" + std::to_string(i), {64, 64}, planner::DType::kBF16});
  planner::WorkerLayout unpacked;
  for (int i = 0; i < tensors; ++i) {
    planner::Piece p;
    p.tensor = i;
    p.box = {{0, 0}, {64, 64}};
    p.strides = {64, 1};
    p.offset_bytes = int64_t{i} * 64 * 64 * 2;
    unpacked.pieces.push_back(p);
  }
  unpacked.buffers.push_back({int64_t{tensors} * 64 * 64 * 2});
  std::shared_ptr<const planner::PackedLayout> layout = *planner::PackedLayout::PackShared(unpacked);
  auto proto = std::make_shared<pb::ResolvedLayout>();
  pb::BufferSpec* b = proto->add_buffers();
  b->set_size_bytes(static_cast<uint64_t>(layout->buffers()[0].size_bytes));
  b->set_shm_name("/wb-test");
  b->set_gpu(-1);
  SliceInput in;
  in.model_id = model;
  in.inventory = inv;
  in.workers.push_back({"t", "n0", planner::Role::kTrainer, -1, layout, proto});
  for (int r = 0; r < 16; ++r) in.workers.push_back({"r" + std::to_string(r), r < 8 ? "n1" : "n2", planner::Role::kRollout, -1, layout, proto});
  for (const char* n : {"n0", "n1", "n2"}) in.nodes[n] = {};
  return in;
}

}  // namespace wb::daemon::testing

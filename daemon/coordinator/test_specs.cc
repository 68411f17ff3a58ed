#include "daemon/coordinator/test_specs.h"

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

}  // namespace wb::daemon::testing

// The planner runs OUTSIDE the coordinator's lock (issue 14): while a plan is being made,
// heartbeats and ClusterStatus are answered. Deterministic: the injected planner blocks until the
// test has seen a heartbeat and a status answered (or gives up after a deadline, failing the test
// instead of hanging it). A second test plans the real Kimi-K2 on 2048 GPUs.
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::daemon {
namespace {

pb::ModelSpec SmallModel(const std::string& id) {
  pb::ModelSpec spec;
  spec.set_model_id(id);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
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

TEST(PlanOutsideLockTest, HeartbeatsAndStatusAreAnsweredWhilePlanning) {
  absl::Notification planning, release;
  Coordinator::Options o;
  o.make_plan = [&](const planner::Problem& p, planner::Strategy s) -> absl::StatusOr<planner::Plan> {
    planning.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
    return planner::MakePlan(p, s);
  };
  Coordinator coord(o);
  coord.Start();
  pb::RegisterNodeRequest rn;
  rn.set_node_id("n0");
  rn.set_address("127.0.0.1:1");  // InstallPlan to it fails later; planning comes first
  pb::RegisterNodeResponse rnr;
  ASSERT_TRUE(coord.RegisterNode(nullptr, &rn, &rnr).ok());
  for (auto [worker, role] : {std::pair{"t0", pb::ROLE_TRAINER}, std::pair{"r0", pb::ROLE_ROLLOUT}}) {
    pb::JoinWorkerRequest j;
    j.set_node_id("n0");
    j.set_worker_id(worker);
    j.set_model_id("m");
    j.set_role(role);
    *j.mutable_model() = SmallModel("m");
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(coord.JoinWorker(nullptr, &j, &jr).ok());
    pb::SubmitLayoutRequest l = WholeTensorLayout("n0", worker);
    pb::SubmitLayoutResponse lr;
    ASSERT_TRUE(coord.SubmitLayout(nullptr, &l, &lr).ok());
  }
  ASSERT_TRUE(planning.WaitForNotificationWithTimeout(absl::Seconds(10))) << "the driver never planned";
  // The planner is blocked now. A heartbeat and a status must be answered meanwhile.
  absl::Notification answered;
  std::thread caller([&] {
    pb::HeartbeatRequest hb;
    hb.set_node_id("n0");
    hb.set_incarnation(rnr.incarnation());
    pb::HeartbeatResponse hbr;
    grpc::Status s = coord.Heartbeat(nullptr, &hb, &hbr);
    EXPECT_TRUE(s.ok()) << s.error_message();
    pb::StatusRequest sr;
    pb::StatusResponse st;
    EXPECT_TRUE(coord.ClusterStatus(nullptr, &sr, &st).ok());
    answered.Notify();
  });
  const bool ok = answered.WaitForNotificationWithTimeout(absl::Seconds(5));
  release.Notify();
  caller.join();
  EXPECT_TRUE(ok) << "heartbeat / ClusterStatus waited for the planner (planning under the coordinator's lock)";
  coord.Shutdown();
}

}  // namespace
}  // namespace wb::daemon

#include "daemon/testing/exec_rendezvous.h"

#include "absl/strings/str_cat.h"

namespace wb::daemon::testing {

node::SliceOp TestSliceOp(uint32_t index, uint32_t bucket, uint32_t src, uint32_t dst, int32_t tensor, planner::Box box, uint64_t bytes) {
  node::SliceOp op;
  op.index = index;
  op.bucket = bucket;
  op.src_worker = src;
  op.dst_worker = dst;
  op.src_piece = 0;
  op.dst_piece = 0;
  op.tensor = tensor;
  op.box = std::move(box);
  op.bytes = bytes;
  return op;
}

void ExecRendezvous::Add(const std::string& node, transport::Transport* t) {
  absl::MutexLock l(&mu_);
  nodes_[node] = t;
}

void ExecRendezvous::Reset() {
  absl::MutexLock l(&mu_);
  desc_.clear();
  endpoints_.clear();
}

absl::Status ExecRendezvous::RunNode(const node::Slice& slice, const std::string& me,
                                     const std::map<std::string, node::RegionMemory>& memory, transport::Transport* local,
                                     transport::Transport* cross, const node::ExecOptions& options, node::ExecResult& result) {
  node::ExecFacts facts;
  facts.me = me;
  for (const auto& [key, m] : memory) facts.kind[key] = m.kind;
  auto plan = node::MakeExecPlan(slice, facts);
  if (!plan.ok()) return plan.status();
  node::ExecTransports t;
  t.local = local;
  t.cross = cross;
  Side side(this, me);
  return node::RunExecPlan(*plan, memory, t, side, options, result);
}

void ExecRendezvous::Side::Publish(std::map<std::string, std::map<std::string, std::string>> descriptors) {
  absl::MutexLock l(&r_->mu_);
  r_->desc_[me_] = std::move(descriptors);
}

absl::StatusOr<node::ChannelLink> ExecRendezvous::Side::Setup(const node::ChannelPlan& c, transport::Transport* t, absl::Time deadline) {
  std::string peer_instance;
  {
    absl::MutexLock l(&r_->mu_);
    peer_instance = r_->nodes_.at(c.peer)->instance_id();
  }
  auto endpoint = t->ExportEndpoint(peer_instance);
  if (!endpoint.ok()) return endpoint.status();
  std::string theirs;
  std::map<std::string, std::string> regions;
  {
    absl::MutexLock l(&r_->mu_);
    r_->endpoints_[{me_, c.peer}] = *endpoint;
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(r_->mu_) {
      return r_->endpoints_.count({c.peer, me_}) > 0 && r_->desc_.count(c.peer) > 0;
    };
    if (!r_->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("node ", c.peer, " did not set up in time"));
    }
    theirs = r_->endpoints_.at({c.peer, me_});
    regions = r_->desc_.at(c.peer)[c.theirs];
  }
  auto id = t->Connect(theirs, deadline);
  if (!id.ok()) return id.status();
  return node::ChannelLink{*id, regions};
}

}  // namespace wb::daemon::testing

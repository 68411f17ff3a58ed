// node::WorkerCalls, part four: the record of one-step-off / async publishes the coordinator
// answered, across the node's re-joins and its own restarts (RecordPublished; status.md item 24,
// docs/daemon.md "Coordinator restart"). See worker_calls.h.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/worker_calls.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon::node {

void WorkerCalls::RecordPublished(const pb::PublishRequest& req, uint64_t incarnation, const std::string& process, const std::string& answered_by,
                                  absl::Time deadline) {
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  local_.NotePublished(key, req.version(), incarnation);
  if (publish_record_ != nullptr && !process.empty()) {
    // Before the trainer hears OK: a node that restarts after it still knows the number is used.
    absl::Status kept = publish_record_->Note({req.model_id(), req.worker_id(), process, req.version(), answered_by});
    if (!kept.ok()) {
      Log(LogLevel::kWarning, "publish not kept in the state directory (a restart of this node forgets it)",
          {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()}, {"error", kept.message()}});
    }
  }
  // Read after NotePublished: a re-join takes its list of workers (Joins) only after the node
  // recorded the new coordinator's instance, so a re-join that missed this record shows here.
  const std::string now = coordinator_.coordinator_instance();
  if (answered_by.empty() || now.empty() || now == answered_by) return;
  // The answer reached the node after it re-joined another coordinator, whose re-join may have
  // reported an older publish: the number would not be known used there. Sent there as a publish
  // whose answer was lost is (PublishAgainAfterRestart: the same snapshot, so the same bytes):
  // the new coordinator runs it, or refuses it (used, not newer) - either way it knows.
  Log(LogLevel::kInfo, "publish answered by the coordinator before a re-join: sent to the new one",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
       {"answered_by", answered_by}, {"now", now}});
  pb::CoordPublishRequest c;
  c.set_node_id(options_.node_id);
  c.set_model_id(req.model_id());
  c.set_worker_id(req.worker_id());
  c.set_version(req.version());
  pb::PublishResponse again;
  uint64_t session = 0;
  absl::Status s = ForwardHeld(req.model_id(), req.worker_id(), deadline, &session, [&](absl::Time dl) {
    c.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(dl - options_.clock->Now())));
    again.Clear();
    return coordinator_.client().Publish(c, &again, CallTimeout(options_.clock, dl));
  });
  Log(s.ok() ? LogLevel::kInfo : LogLevel::kWarning, "publish answered before a re-join: the new coordinator's answer",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
       {"answer", s.ok() ? std::string("OK") : std::string(s.message())}});
}

}  // namespace wb::daemon::node

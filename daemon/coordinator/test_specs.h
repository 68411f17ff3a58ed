#pragma once
// TEST ONLY. The small model and layout the coordinator tests register: one bf16 [4, 4] tensor "w"
// (explicit tensors), and a worker layout holding it whole in one 32-byte host buffer; and a big
// planner input for tests that need the planner to work a while (cancellation).

#include <string>

#include "daemon/coordinator/slicer.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon::testing {

namespace pb = ::weightbridge::v1;

// One trainer and `rollouts` rollouts; the mode is left unset (callers set it when it matters).
pb::ModelSpec SmallModelSpec(const std::string& id, int rollouts = 1);

// `worker` on `node` holds tensor "w" of model "m" whole (shm "/wb-test-<worker>", row-major).
pb::SubmitLayoutRequest WholeTensorLayout(const std::string& node, const std::string& worker);

// Enough work that the planner polls many times: `tensors` bf16 tensors of 64 x 64 held whole by a
// host-memory trainer "t" on n0 and needed whole by 16 host-memory rollouts "r0".."r15" on n1 and
// n2 (one op per tensor per rollout).
SliceInput BigSliceInput(const std::string& model, int tensors);

// What a fake node reports when `req` (a version, not a catch-up) ran through on `node`: done, ok.
pb::ReportDoneRequest DoneReport(const std::string& node, const pb::ExecuteVersionRequest& req);

}  // namespace wb::daemon::testing

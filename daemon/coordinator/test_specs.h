#pragma once
// TEST ONLY. The small model and layout the coordinator tests register: one bf16 [4, 4] tensor "w"
// (explicit tensors), and a worker layout holding it whole in one 32-byte host buffer.

#include <string>

#include "proto/weightbridge.pb.h"

namespace wb::daemon::testing {

namespace pb = ::weightbridge::v1;

// One trainer and `rollouts` rollouts; the mode is left unset (callers set it when it matters).
pb::ModelSpec SmallModelSpec(const std::string& id, int rollouts = 1);

// `worker` on `node` holds tensor "w" of model "m" whole (shm "/wb-test-<worker>", row-major).
pb::SubmitLayoutRequest WholeTensorLayout(const std::string& node, const std::string& worker);

}  // namespace wb::daemon::testing

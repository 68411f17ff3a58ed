#pragma once
// `wbctl layout`: where a worker's local tensors live in its buffer and how large the buffer must
// be (layout discovery, docs/integration.md), for a preset rank.
//
//   wbctl layout --config CONFIG.json --preset P [--tp N --pp N --dp N --ep N --etp N --replicas N
//                --expert_parallel --expert_placement E --quantization Q --first_stage_layers N
//                --last_stage_layers N --vpp N] --rank R [--dtype bfloat16] [--json]
//       offline: computed here from an HF config.json, with the daemon's own code
//       (daemon/layout_discovery.h), no daemon needed;
//   wbctl layout --addr unix:PATH --model ID --preset P ... --rank R [--config CONFIG.json] [--json]
//       asks the node daemon behind a worker socket (WorkerService.DescribeLayout): the model as
//       the node holds it, or the --config spec when the node does not know it yet.
//
// Output: the buffer size, then one line per local tensor (offset, bytes, dtype, shape, strides,
// name, and for quantised tensors their scales tensor), then the bytes the pieces cover. --json:
// the LayoutDescription message as JSON (proto field names).
// Exit codes: 0 ok, 1 RPC failed / daemon unavailable / the layout does not fit the model,
// 2 usage (client/ctl_client.h).

#include <ostream>
#include <string>
#include <vector>

#include "proto/weightbridge.pb.h"

namespace wb::client {

int RunLayoutCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// The human-readable listing (exposed for tests).
std::string LayoutTable(const weightbridge::v1::LayoutDescription& d, const std::string& title);

}  // namespace wb::client

#pragma once
// Helpers shared by the end-to-end tests: reading worker progress events, and the expectations
// every run must meet (clean exits, no mismatch, every byte of every version verified).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/harness.h"

namespace wb::e2e {

// Events of `p` named `event`.
std::vector<nlohmann::json> EventsNamed(const Process* p, const std::string& event);

// OK when `p` exits 0 within `timeout`; otherwise an error carrying its log tail.
absl::Status ExpectCleanExit(const Process* p, absl::Duration timeout);

// Sum of the "bytes" of rollout `p`'s "verified" events for `version` with why == "applied".
int64_t VerifiedBytes(const Process* p, uint64_t version);

// Path of the test model config (the reduced 2-layer Qwen2.5-0.5B unless `full`; in sanitizer
// builds, the same family with a smaller vocabulary and MLP, testdata/README.md).
std::string ModelConfigPath(bool full = false);

// kTimeScale / Scaled / ScaledMs (sanitizer builds): harness.h.

// Total bytes (bf16) of the model's canonical tensors.
int64_t ModelBytes(const std::string& config_path);

}  // namespace wb::e2e

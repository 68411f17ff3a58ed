#pragma once
// Deterministic fingerprints (XXH3-128, hex). They depend only on values (names, shapes, boxes,
// strides, topology, ops in bucket order), never on addresses or hash-map iteration order, so equal
// inputs give equal strings on every machine. Used to cache plans by layout and to check that two
// processes hold the same plan.

#include <string>

#include "planner/types.h"

namespace wb::planner {

// Over the problem only (inventory, workers with layouts, topology, staging budget).
std::string ProblemFingerprint(const Problem& problem);

// Over the problem and the plan (strategy, buckets, ops). Ignores plan.stats and plan.fingerprint.
std::string Fingerprint(const Problem& problem, const Plan& plan);

}  // namespace wb::planner

#pragma once
// Finding plan specs for the benches that run over the repository's examples/specs (planner, rl_sim).

#include <string>
#include <vector>

namespace wb::bench {

// The directory benches read specs from by default: examples/specs of the workspace (`bazel run`
// sets BUILD_WORKSPACE_DIRECTORY), or relative to the current directory.
std::string DefaultSpecsDir();

// Every *.json file directly in `dir`, sorted; empty when the directory can't be read.
std::vector<std::string> JsonFiles(const std::string& dir);

}  // namespace wb::bench

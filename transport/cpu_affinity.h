#pragma once
// CPU affinity for the data plane's threads (host_tcp stream threads, host_shm copy threads), so
// that the threads moving a NIC's bytes run on the NUMA node that NIC and the staging memory sit
// on. Empty set = threads float (the default).
//
// ParseCpuList is pure (the kernel's cpulist syntax, as in /sys/devices/system/node/nodeN/cpulist
// and `taskset -c`): "0-3,8,10-11" -> {0,1,2,3,8,10,11}. The other functions read the system.

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

// "0-3,8,10-11" -> sorted, de-duplicated CPU numbers. Whitespace around items and a trailing
// newline are accepted (sysfs files end in one). INVALID_ARGUMENT, naming the bad item, for an
// empty list, an empty item, a non-number, a descending range or a CPU >= CPU_SETSIZE.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text);

// "0-3,8": the inverse of ParseCpuList (for messages and logs).
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs of NUMA node `node`, read from <sysfs_node_dir>/node<node>/cpulist and intersected with
// the CPUs this process may run on (a container's cpuset may hold only part of the node).
// NOT_FOUND when the node does not exist, FAILED_PRECONDITION when none of its CPUs is allowed.
absl::StatusOr<std::vector<int>> NumaNodeCpus(int node,
                                              absl::string_view sysfs_node_dir = "/sys/devices/system/node");

// The CPUs this process may run on now (sched_getaffinity of the calling thread).
absl::StatusOr<std::vector<int>> AllowedCpus();

// OK if `cpus` is non-empty and every CPU in it is one this process may run on; else
// INVALID_ARGUMENT naming the CPUs that are not (pthread_setaffinity_np would fail or the
// threads would silently run elsewhere).
absl::Status ValidateCpuSet(const std::vector<int>& cpus);

// Restricts thread `t` to `cpus` (pthread_setaffinity_np). An empty set is a no-op (threads float).
absl::Status PinThread(std::thread& t, const std::vector<int>& cpus);

}  // namespace wb::transport

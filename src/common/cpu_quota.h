// The CPU quota of the process's cgroup, as a whole number of CPUs. In a
// container with a CPU limit (Kubernetes `resources.limits.cpu`, `docker
// run --cpus`) the affinity mask still shows every CPU of the node; the
// limit is a cgroup quota: cgroup v2 `cpu.max` ("200000 100000" is two
// CPUs), cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`.
#pragma once

#include <filesystem>

namespace shoal {

// The tightest quota on the process's cgroup and its ancestors, rounded up
// to whole CPUs (1.5 CPUs -> 2); 0 when there is none or it cannot be read.
// Reads `self_cgroup` (/proc/self/cgroup) for the process's cgroup and
// `mountinfo` (/proc/self/mountinfo) for where the controller is mounted.
int CgroupCpuLimit(const std::filesystem::path& mountinfo = "/proc/self/mountinfo",
                   const std::filesystem::path& self_cgroup = "/proc/self/cgroup");

}  // namespace shoal

#include "common/cpu_quota.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace shoal {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}

bool HasToken(const std::string& list, const std::string& token) {
  for (const std::string& t : Split(list, ','))
    if (t == token) return true;
  return false;
}

std::optional<std::string> ReadFirstLine(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<int64_t> ParseInt(const std::string& s) {
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    if (used != s.size()) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}

// CPUs one cgroup directory allows (quota / period); nullopt: no limit here.
std::optional<double> LimitAt(const fs::path& dir, bool v2) {
  int64_t quota = -1, period = 0;
  if (v2) {
    auto line = ReadFirstLine(dir / "cpu.max");  // "max 100000" or "200000 100000"
    if (!line) return std::nullopt;
    std::istringstream in(*line);
    std::string q, p;
    in >> q >> p;
    if (q == "max") return std::nullopt;
    auto qv = ParseInt(q), pv = ParseInt(p);
    if (!qv || !pv) return std::nullopt;
    quota = *qv, period = *pv;
  } else {
    auto q = ReadFirstLine(dir / "cpu.cfs_quota_us"), p = ReadFirstLine(dir / "cpu.cfs_period_us");
    if (!q || !p) return std::nullopt;
    auto qv = ParseInt(*q), pv = ParseInt(*p);
    if (!qv || !pv) return std::nullopt;
    quota = *qv, period = *pv;
  }
  if (quota <= 0 || period <= 0) return std::nullopt;  // -1: no quota (v1)
  return static_cast<double>(quota) / static_cast<double>(period);
}

struct Mount {
  std::string root;        // the cgroup this mount shows at its mount point
  fs::path mount_point;
};

// mountinfo escapes space, tab, newline and backslash as \ooo (octal).
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    auto octal = [&](size_t k) { return k < s.size() && s[k] >= '0' && s[k] <= '7'; };
    if (s[i] == '\\' && octal(i + 1) && octal(i + 2) && octal(i + 3)) {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// `path` relative to `root` ("" when equal); nullopt when it is not inside.
std::optional<std::string> Inside(const std::string& path, const std::string& root) {
  if (path.empty() || path[0] != '/') return std::nullopt;
  if (root == "/") return path.substr(1);
  if (path == root) return std::string();
  if (path.size() > root.size() && path.compare(0, root.size(), root) == 0 && path[root.size()] == '/')
    return path.substr(root.size() + 1);
  return std::nullopt;
}

}  // namespace

int CgroupCpuLimit(const fs::path& mountinfo, const fs::path& self_cgroup) {
  // The process's cgroup: v1 "N:cpu,cpuacct:/path", v2 "0::/path".
  std::optional<std::string> path_v1, path_v2;
  {
    std::ifstream in(self_cgroup);
    std::string line;
    while (std::getline(in, line)) {
      const size_t a = line.find(':');
      const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const std::string controllers = line.substr(a + 1, b - a - 1);
      std::string path = line.substr(b + 1);
      const std::string deleted = " (deleted)";  // cgroup v2, a removed cgroup
      if (path.size() > deleted.size() && path.compare(path.size() - deleted.size(), deleted.size(), deleted) == 0)
        path.resize(path.size() - deleted.size());
      if (line.substr(0, a) == "0" && controllers.empty()) path_v2 = path;
      if (HasToken(controllers, "cpu")) path_v1 = path;
    }
  }
  // Where the controller is mounted: "id parent dev root mount-point opts
  // [optional...] - fstype source super-opts". Of several mounts, the one
  // showing the deepest cgroup that holds the process (a container's mount
  // shows its own cgroup at the mount point).
  std::optional<Mount> mount_v1, mount_v2;
  std::string rel_v1, rel_v2;
  {
    std::ifstream in(mountinfo);
    std::string line;
    while (std::getline(in, line)) {
      const size_t dash = line.find(" - ");
      if (dash == std::string::npos) continue;
      std::istringstream left(line.substr(0, dash)), right(line.substr(dash + 3));
      std::string id, parent, dev, root, mount_point, fstype, source, super_opts;
      if (!(left >> id >> parent >> dev >> root >> mount_point) || !(right >> fstype >> source >> super_opts)) continue;
      root = Unescape(root);
      const bool v1 = fstype == "cgroup" && HasToken(super_opts, "cpu");
      if (!v1 && fstype != "cgroup2") continue;
      const std::optional<std::string>& path = v1 ? path_v1 : path_v2;
      if (!path) continue;
      const std::optional<std::string> rel = Inside(*path, root);
      if (!rel) continue;  // this mount does not show the process's cgroup
      std::optional<Mount>& best = v1 ? mount_v1 : mount_v2;
      if (best && best->root.size() >= root.size()) continue;
      best = Mount{root, Unescape(mount_point)};
      (v1 ? rel_v1 : rel_v2) = *rel;
    }
  }
  const bool v2 = !mount_v1.has_value();
  const std::optional<Mount>& mount = v2 ? mount_v2 : mount_v1;
  if (!mount) return 0;
  const std::string& rel = v2 ? rel_v2 : rel_v1;
  for (const auto& part : fs::path(rel))
    if (part == "..") return 0;
  const fs::path top = mount->mount_point;
  fs::path dir = rel.empty() ? top : top / rel;
  // The effective limit is the tightest on the way up to the mount point.
  std::optional<double> cpus;
  for (;;) {
    if (auto here = LimitAt(dir, v2)) cpus = cpus ? std::min(*cpus, *here) : *here;
    if (dir == top || !dir.has_parent_path() || dir.parent_path() == dir) break;
    dir = dir.parent_path();
  }
  if (!cpus) return 0;
  // A quota of the kernel's largest (2^44 µs a period) is no limit on any
  // machine, not an int overflow.
  return static_cast<int>(std::clamp(std::ceil(*cpus - 1e-9), 1.0, 1e6));
}

}  // namespace shoal

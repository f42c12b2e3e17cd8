#include "common/cpu_quota.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace shoal {
namespace {

namespace fs = std::filesystem;

// A fake /proc/self and /sys/fs/cgroup under a temporary directory.
class CpuQuotaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "shoal-cpuquota-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const fs::path& rel, const std::string& text) {
    fs::create_directories((dir_ / rel).parent_path());
    std::ofstream(dir_ / rel) << text;
  }
  // One cgroup v2 mount at <dir>/cg showing `root`; the process in `path`.
  void V2(const std::string& root, const std::string& path) {
    Write("mountinfo", "30 22 0:27 " + root + " " + (dir_ / "cg").string() +
                           " rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n");
    Write("cgroup", "0::" + path + "\n");
  }
  // cgroup v1 with cpu,cpuacct mounted at <dir>/cpu.
  void V1(const std::string& root, const std::string& path) {
    Write("mountinfo",
          "30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
          "31 30 0:28 " + root + " " + (dir_ / "cpu").string() + " rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
          "33 30 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n");
    Write("cgroup", "9:cpuset:/\n4:cpu,cpuacct:" + path + "\n1:name=systemd:/init.scope\n");
  }
  int Limit() { return CgroupCpuLimit(dir_ / "mountinfo", dir_ / "cgroup"); }

  fs::path dir_;
};

TEST_F(CpuQuotaTest, V2QuotaRoundsUpToWholeCpus) {
  V2("/", "/kubepods/pod1/c1");
  Write("cg/kubepods/pod1/c1/cpu.max", "150000 100000\n");
  EXPECT_EQ(Limit(), 2);
  Write("cg/kubepods/pod1/c1/cpu.max", "400000 100000\n");
  EXPECT_EQ(Limit(), 4);
  Write("cg/kubepods/pod1/c1/cpu.max", "20000 100000\n");  // a fifth of a CPU is still one
  EXPECT_EQ(Limit(), 1);
}

TEST_F(CpuQuotaTest, V2WithoutAQuotaIsZero) {
  V2("/", "/user.slice");
  Write("cg/user.slice/cpu.max", "max 100000\n");
  EXPECT_EQ(Limit(), 0);
}

TEST_F(CpuQuotaTest, TheTightestAncestorWins) {
  V2("/", "/kubepods/pod1/c1");
  Write("cg/kubepods/pod1/c1/cpu.max", "max 100000\n");
  Write("cg/kubepods/pod1/cpu.max", "300000 100000\n");
  Write("cg/kubepods/cpu.max", "800000 100000\n");
  EXPECT_EQ(Limit(), 3);
}

TEST_F(CpuQuotaTest, AContainersOwnMountShowsItsCgroupAtTheMountPoint) {
  // cgroup namespace: the mount's root is the container's cgroup, and the
  // process sees itself at "/".
  V2("/kubepods/pod1/c1", "/");
  Write("cg/cpu.max", "200000 100000\n");
  EXPECT_EQ(Limit(), 2);
  // Without a namespace: the full path, mounted from the container's cgroup.
  V2("/kubepods/pod1/c1", "/kubepods/pod1/c1");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CpuQuotaTest, V1QuotaAndPeriod) {
  V1("/", "/docker/abc");
  Write("cpu/docker/abc/cpu.cfs_quota_us", "250000\n");
  Write("cpu/docker/abc/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 3);
  Write("cpu/docker/abc/cpu.cfs_quota_us", "-1\n");  // no quota
  EXPECT_EQ(Limit(), 0);
}

TEST_F(CpuQuotaTest, MissingOrGarbledFilesMeanNoLimit) {
  EXPECT_EQ(Limit(), 0);  // no mountinfo, no cgroup file
  V2("/", "/a");
  EXPECT_EQ(Limit(), 0);  // no cpu.max
  Write("cg/a/cpu.max", "lots 100000\n");
  EXPECT_EQ(Limit(), 0);
  Write("cg/a/cpu.max", "100000 0\n");
  EXPECT_EQ(Limit(), 0);
}

}  // namespace
}  // namespace shoal

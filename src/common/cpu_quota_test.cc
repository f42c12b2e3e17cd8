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
  // The kernel's largest quota is no limit worth the name, not an int
  // overflow that read as one CPU.
  Write("cg/kubepods/pod1/c1/cpu.max", "17592186044415 1000\n");
  EXPECT_EQ(Limit(), 1000000);
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
  Write("cg/kubepods/cpu.max", "200000 100000\n");  // further up, but tighter
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CpuQuotaTest, AContainersOwnMountShowsItsCgroupAtTheMountPoint) {
  // The mount's root is the container's cgroup; the process's path is the
  // full one. A decoy at the unstripped path would give 1.
  V2("/kubepods/pod1/c1", "/kubepods/pod1/c1/app");
  Write("cg/cpu.max", "200000 100000\n");
  Write("cg/kubepods/pod1/c1/app/cpu.max", "100000 100000\n");
  EXPECT_EQ(Limit(), 2);  // its own cgroup is cg/app (no quota), then cg
  Write("cg/app/cpu.max", "300000 100000\n");  // looser than the container's
  EXPECT_EQ(Limit(), 2);
  Write("cg/app/cpu.max", "100000 100000\n");
  EXPECT_EQ(Limit(), 1);
}

TEST_F(CpuQuotaTest, APathOutsideTheMountsRootReadsNothing) {
  // "/kubepods/pod1/c10" is not inside "/kubepods/pod1/c1" although the
  // string starts with it: the quota at the mount point is another cgroup's.
  V2("/kubepods/pod1/c1", "/kubepods/pod1/c10");
  Write("cg/cpu.max", "100000 100000\n");
  EXPECT_EQ(Limit(), 0);
  V2("/", "/a/../../etc");
  EXPECT_EQ(Limit(), 0);
}

TEST_F(CpuQuotaTest, EscapedMountPointsAndHybridHierarchies) {
  // A mount point with a space (written \040), and a hybrid system with
  // both the v1 cpu controller and a v2 "unified" mount: v1 has the quota.
  const fs::path cpu = dir_ / "cpu acct";
  Write("mountinfo",
        "31 30 0:28 / " + (dir_ / "cpu\\040acct").string() + " rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 30 0:33 / " + (dir_ / "unified").string() + " rw - cgroup2 cgroup2 rw\n");
  Write("cgroup", "4:cpu,cpuacct:/svc\n0::/svc\n");
  Write("cpu acct/svc/cpu.cfs_quota_us", "200000\n");
  Write("cpu acct/svc/cpu.cfs_period_us", "100000\n");
  Write("unified/svc/cpu.max", "max 100000\n");
  EXPECT_EQ(Limit(), 2);
  // A removed cgroup v2 path carries " (deleted)".
  V2("/", "/gone (deleted)");
  Write("cg/gone/cpu.max", "300000 100000\n");
  EXPECT_EQ(Limit(), 3);
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

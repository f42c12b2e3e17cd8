#include "common/device.h"

#include <gtest/gtest.h>

#include "common/model_config.h"

namespace shoal {
namespace {

TEST(ParseDevice, AcceptsTheCpuAndCudaOrdinals) {
  auto cpu = ParseDevice("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_FALSE(cpu->cuda);
  EXPECT_EQ(cpu->ToString(), "cpu");
  auto cuda = ParseDevice("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_TRUE(cuda->cuda);
  EXPECT_EQ(cuda->ToString(), "cuda:0");
  auto third = ParseDevice("cuda:2");
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->index, 2);
  EXPECT_EQ(third->ToString(), "cuda:2");
}

TEST(ParseDevice, RejectsEverythingElseAsInvalidDevice) {
  for (const char* bad : {"", "gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:-0", "cuda:+1", "cuda:1x", "cuda:256",
                          "cuda: 1", "cuda:99999999999", "cpu:0", "mps"}) {
    auto d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(d.status().reason(), "invalid_device") << bad;
  }
}

TEST(ParseDevice, AModelConfigWithABadDeviceDoesNotValidate) {
  ModelConfig c;
  c.name = "m";
  c.device = "cuda:0";
  EXPECT_TRUE(c.Validate().ok());
  c.device = "gpu0";
  Status s = c.Validate();
  EXPECT_EQ(s.reason(), "invalid_device");
  EXPECT_NE(s.message().find("gpu0"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace shoal

#include "runtime/runtime.h"

#include <gtest/gtest.h>

namespace shoal {
namespace {

TEST(CreateRuntime, UnknownKindIsNotFound) {
  auto r = CreateRuntime("tensorrt");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().reason(), "runtime_not_found");
  EXPECT_NE(r.status().message().find("tensorrt"), std::string::npos);
}

TEST(CreateRuntime, EmptyKindIsNotFound) {
  auto r = CreateRuntime("");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

TEST(CreateRuntime, MakesUnloadedRuntimes) {
  for (const char* kind : {"null", "torchscript"}) {
    auto r = CreateRuntime(kind);
    ASSERT_TRUE(r.ok()) << kind << ": " << r.status().ToString();
    ASSERT_NE(r->get(), nullptr);
    TokenBatch batch{1, 1, {101}, {1}, {}};
    auto out = (*r)->Run(batch);
    ASSERT_FALSE(out.ok()) << kind;
    EXPECT_EQ(out.status().code(), StatusCode::kUnavailable) << kind;
    (*r)->Unload();  // safe on a never-loaded runtime
  }
}

TEST(CreateRuntime, TorchScriptMissingModelIsNotFound) {
  auto r = CreateRuntime("torchscript");
  ASSERT_TRUE(r.ok());
  ModelConfig config;
  config.name = "ghost";
  config.dir = "/nonexistent/shoal/models/ghost";
  const Status st = (*r)->Load(config);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
}

TEST(ItemError, RoundTripsAndLeavesOtherDocumentsAlone) {
  const Status st = ParseItemError(ItemError(Unprocessable("too long", "context_length_exceeded")));
  EXPECT_EQ(st.code(), StatusCode::kUnprocessable);
  EXPECT_EQ(st.message(), "too long");
  EXPECT_EQ(st.reason(), "context_length_exceeded");
  EXPECT_TRUE(ParseItemError("\x81\xa4text\xa2hi").ok());                 // a result
  EXPECT_TRUE(ParseItemError("\x81\xa5" "error\x01").ok());                  // error but not a map
  EXPECT_TRUE(ParseItemError(std::string("\x81\xa5" "error\x81", 8)).ok());  // truncated
  EXPECT_TRUE(ParseItemError("").ok());
}

}  // namespace
}  // namespace shoal

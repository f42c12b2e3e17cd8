#include "common/status.h"

#include <gtest/gtest.h>

namespace shoal {
namespace {

Result<int> Half(int v) {
  if (v % 2) return InvalidArgument("odd");
  return v / 2;
}

Result<int> Quarter(int v) {
  ASSIGN_OR_RETURN(int h, Half(v));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(Status, MapsCodesToHttpAndOpenAITypes) {
  EXPECT_EQ(HttpStatusFor(StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFor(StatusCode::kPayloadTooLarge), 413);
  EXPECT_EQ(HttpStatusFor(StatusCode::kUnprocessable), 422);
  EXPECT_EQ(HttpStatusFor(StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatusFor(StatusCode::kBadGateway), 502);
  EXPECT_EQ(ErrorTypeFor(StatusCode::kNotFound), "invalid_request_error");
  EXPECT_EQ(ErrorTypeFor(StatusCode::kInternal), "server_error");
}

TEST(Status, CodeNamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(StatusCode::kUnsupportedMedia); ++i) {
    auto c = static_cast<StatusCode>(i);
    EXPECT_EQ(ParseStatusCode(StatusCodeName(c)), c);
  }
  EXPECT_EQ(ParseStatusCode("no-such-code"), StatusCode::kInternal);
}

TEST(Status, ReasonDefaultsToCodeName) {
  EXPECT_EQ(NotFound("x").ReasonOrDefault(), "not_found");
  EXPECT_EQ(NotFound("x", "model_not_found").ReasonOrDefault(), "model_not_found");
}

TEST(Result, PropagatesErrorsThroughMacros) {
  EXPECT_EQ(*Quarter(8), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd");
}

}  // namespace
}  // namespace shoal

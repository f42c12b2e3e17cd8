#include "common/log.h"

#include <string>

#include <gtest/gtest.h>

namespace shoal {
namespace {

// A message may quote text from outside (a runtime's error, a client's
// input): it stays on its own line, with control characters escaped, so it
// cannot forge further log lines, send terminal escapes or be cut at a NUL.
TEST(Log, AMessageIsOneLineWithControlCharactersEscaped) {
  ::testing::internal::CaptureStderr();
  LogLine(LogLevel::kWarn, "runtime", std::string("bad input\n2026-01-01T00:00:00.000Z ERROR [gateway] forged\r\x1b[2J\tend\0after", 72));
  const std::string out = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;  // one line
  EXPECT_NE(out.find("WARN  [runtime] bad input\\n2026-01-01T00:00:00.000Z ERROR [gateway] forged\\r\\x1b[2J\tend\\x00after"),
            std::string::npos)
      << out;
  // C1 controls (CSI as U+009B) are escaped too; other UTF-8 is kept.
  ::testing::internal::CaptureStderr();
  LogLine(LogLevel::kInfo, "x", "a\xc2\x9b" "2J caf\xc3\xa9 \xc2\xa0");
  const std::string c1 = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(c1.find("[x] a\\u009b2J caf\xc3\xa9 \xc2\xa0\n"), std::string::npos) << c1;
}

}  // namespace
}  // namespace shoal

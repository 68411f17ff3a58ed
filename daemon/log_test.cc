#include "daemon/log.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

TEST(LogTest, FormatsFieldsAndQuotes) {
  std::string line = FormatLogLine(LogLevel::kWarning, "version aborted",
                                   {{"model", "qwen"}, {"version", 3}, {"reason", "node n1 lost \"lease\""}});
  EXPECT_EQ(line, "level=warning msg=\"version aborted\" model=qwen version=3 reason=\"node n1 lost \\\"lease\\\"\"");
}

TEST(LogTest, LevelsFilter) {
  SetLogLevel(LogLevel::kWarning);
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));
  SetLogLevel(LogLevel::kDebug);
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug));
  SetLogLevel(LogLevel::kInfo);
}

TEST(LogTest, ParsesLevels) {
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("error"), LogLevel::kError);
  EXPECT_FALSE(ParseLogLevel("verbose").ok());
}

}  // namespace
}  // namespace wb::daemon

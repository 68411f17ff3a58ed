// node::PublishRecord: what a trainer's node keeps of its trainers' answered publishes over its own
// restart (status.md item 24): read back by the next process of the same node, only the entries
// whose trainer process still runs, bounded, a corrupt file dropped without a crash.
#include "daemon/node/publish_record.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"

namespace wb::daemon::node {
namespace {

class PublishRecordTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/publish-record-", ::getpid(), "-", ++counter_);
    ASSERT_EQ(::mkdir(dir_.c_str(), 0700), 0) << dir_;
  }
  std::unique_ptr<PublishRecord> Open(const std::string& node, std::function<bool(const std::string&)> alive = nullptr) {
    auto r = PublishRecord::Open(dir_, node, alive);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }
  std::string dir_;
  static inline int counter_ = 0;
};

TEST_F(PublishRecordTest, TheNextProcessOfTheNodeReadsItBack) {
  {
    auto r = Open("n0");
    ASSERT_TRUE(r->Note({"m", "t0", "100@5", 2, "A"}).ok());
    ASSERT_TRUE(r->Note({"m", "t1", "101@5", 3, "A"}).ok());
    ASSERT_TRUE(r->Note({"m", "t0", "100@5", 4, "B"}).ok());  // newer: replaces
    ASSERT_TRUE(r->Note({"m", "t0", "100@5", 3, "B"}).ok());  // older of the same process: ignored
  }
  auto again = Open("n0");
  ASSERT_EQ(again->size(), 2u);
  EXPECT_EQ(again->Find("m", "t0"), (PublishEntry{"m", "t0", "100@5", 4, "B"}));
  EXPECT_EQ(again->Find("m", "t1"), (PublishEntry{"m", "t1", "101@5", 3, "A"}));
  EXPECT_FALSE(again->Find("m", "t2").has_value());
  // Another node sharing the directory has its own file.
  EXPECT_EQ(Open("n1")->size(), 0u);
}

TEST_F(PublishRecordTest, ANewProcessOfTheWorkerReplacesTheEntryAndForgetRemovesIt) {
  auto r = Open("n0");
  ASSERT_TRUE(r->Note({"m", "t0", "100@5", 9, "A"}).ok());
  ASSERT_TRUE(r->Note({"m", "t0", "200@7", 1, "A"}).ok());  // another process: its own numbers
  EXPECT_EQ(r->Find("m", "t0")->version, 1u);
  r->Forget("m", "t0");
  EXPECT_FALSE(r->Find("m", "t0").has_value());
  EXPECT_NE(::access(r->path().c_str(), F_OK), 0) << "an empty record leaves no file";
  EXPECT_EQ(Open("n0")->size(), 0u);
}

TEST_F(PublishRecordTest, EntriesOfProcessesThatAreGoneAreDroppedAtOpen) {
  {
    auto r = Open("n0");
    ASSERT_TRUE(r->Note({"m", "t0", "100@5", 2, "A"}).ok());
    ASSERT_TRUE(r->Note({"m", "t1", "101@5", 3, "A"}).ok());
  }
  std::set<std::string> asked;
  auto r = Open("n0", [&](const std::string& p) {
    asked.insert(p);
    return p == "101@5";
  });
  EXPECT_EQ(asked, (std::set<std::string>{"100@5", "101@5"}));
  EXPECT_FALSE(r->Find("m", "t0").has_value());
  EXPECT_TRUE(r->Find("m", "t1").has_value());
  EXPECT_EQ(Open("n0")->size(), 1u) << "the dropped entry is gone from the file too";
}

TEST_F(PublishRecordTest, OddNamesRoundTrip) {
  const PublishEntry odd{"m\tx\n", "w\\0 \"q\"", "1@2", 7, "inst\n"};
  {
    auto r = Open("n0");
    ASSERT_TRUE(r->Note(odd).ok());
  }
  EXPECT_EQ(Open("n0")->Find(odd.model, odd.worker), odd);
}

TEST_F(PublishRecordTest, ACorruptFileIsDroppedNotFatal) {
  std::string path;
  {
    auto r = Open("n0");
    ASSERT_TRUE(r->Note({"m", "t0", "100@5", 2, "A"}).ok());
    path = r->path();
  }
  for (const std::string& text : {std::string("garbage\n"), absl::StrCat("weightbridge-publish-record 1\nm\tt0\t100@5\tnot-a-number\tA\n"),
                                  absl::StrCat("weightbridge-publish-record 1\nm\tt0\t100@5\t0\tA\n"), std::string("")}) {
    std::ofstream(path, std::ios::trunc) << text;
    auto r = Open("n0");
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->size(), 0u) << text;
  }
  std::ofstream(path, std::ios::trunc) << std::string(PublishRecord::kMaxFileBytes + 1, 'x');
  EXPECT_EQ(Open("n0")->size(), 0u) << "oversized";
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "a corrupt file is deleted";
}

TEST_F(PublishRecordTest, BoundedToTheNewestEntries) {
  auto r = Open("n0");
  for (size_t i = 0; i < PublishRecord::kMaxEntries + 3; ++i) {
    ASSERT_TRUE(r->Note({"m", absl::StrCat("t", i), "1@1", 1, "A"}).ok());
  }
  EXPECT_EQ(r->size(), PublishRecord::kMaxEntries);
  EXPECT_FALSE(r->Find("m", "t0").has_value()) << "the oldest written goes first";
  EXPECT_TRUE(r->Find("m", absl::StrCat("t", PublishRecord::kMaxEntries + 2)).has_value());
  EXPECT_EQ(Open("n0")->size(), PublishRecord::kMaxEntries);
}

}  // namespace
}  // namespace wb::daemon::node

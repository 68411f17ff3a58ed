#include "daemon/node/live_markers.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "base/shm_segment.h"

namespace wb::daemon {
namespace {

std::string TempDir(const std::string& tag) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base != nullptr ? base : "/tmp") + "/markers-" + tag + "-" + std::to_string(::getpid());
  return dir;
}

int CountFiles(const std::string& dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (struct dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

struct Segment {
  std::shared_ptr<transport::ShmSegment> seg;
  std::vector<SegmentId> ids;
};
Segment MakeSegment() {
  auto s = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("mk"), 4096);
  EXPECT_TRUE(s.ok()) << s.status();
  Segment out;
  out.seg = std::make_shared<transport::ShmSegment>(std::move(*s));
  auto ids = IdentifySegments({out.seg});
  EXPECT_TRUE(ids.ok()) << ids.status();
  out.ids = *ids;
  return out;
}

LiveMarker MarkerFor(const std::string& worker, const Segment& s) {
  LiveMarker m;
  m.model = "m";
  m.worker = worker;
  m.writing = 2;
  m.over = 1;
  m.segments = s.ids;
  return m;
}

TEST(LiveMarkersTest, SerializeParseRoundTripAndCorruptTextIsAnError) {
  LiveMarker m;
  m.node = "n\n0";
  m.model = "model=with\nodd";
  m.worker = "rollout/3";
  m.writing = 7;
  m.over = 6;
  m.daemon_pid = 42;
  m.reason = "why";
  m.segments = {{"/wb-a:b", 1, 2}};
  auto back = LiveMarkers::Parse(LiveMarkers::Serialize(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->node, m.node);
  EXPECT_EQ(back->model, m.model);
  EXPECT_EQ(back->worker, m.worker);
  EXPECT_EQ(back->writing, 7u);
  EXPECT_EQ(back->over, 6u);
  EXPECT_EQ(back->daemon_pid, 42);
  EXPECT_EQ(back->reason, "why");
  EXPECT_TRUE(back->segments == m.segments);
  for (const std::string& bad : std::vector<std::string>{"", "garbage", "weightbridge-live-marker 1\nworker=w\n", "weightbridge-live-marker 1\nmodel=m\nworker=w\nwriting=x\n",
                                "weightbridge-live-marker 1\nmodel=m\nworker=w\nwriting=1\nsegment=1:2\n",
                                "weightbridge-live-marker 1\nmodel=m\nworker=w\nwriting=1\nunknown=1\n", std::string(100000, 'x')}) {
    EXPECT_FALSE(LiveMarkers::Parse(bad).ok()) << bad.substr(0, 60);
  }
}

// A marker recorded by one process is found by the next one (same node id) when the same worker
// registers the same memory; Clear removes it; another node's markers are left alone.
TEST(LiveMarkersTest, LeftoverIsClaimedByTheSameWorkerOnTheSameMemoryOnly) {
  const std::string dir = TempDir("claim");
  Segment a = MakeSegment(), b = MakeSegment();
  {
    auto first = LiveMarkers::Open(dir, "n0");
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE((*first)->Record(MarkerFor("r0", a)).ok());
    ASSERT_TRUE((*first)->Record(MarkerFor("r1", b)).ok());
    auto other = LiveMarkers::Open(dir, "n1");
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->Record(MarkerFor("r0", a)).ok());
    // first "dies" here: its markers stay.
  }
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto second = LiveMarkers::Open(dir, "n0");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->leftovers(), 2u);
  (*second)->Clear("r0");  // RegisterWorker forgets the worker before its RegisterLayout brings the memory
  EXPECT_EQ((*second)->leftovers(), 2u) << "a leftover waits for Claim";
  EXPECT_FALSE((*second)->Claim("other-model", "r1", b.ids).has_value()) << "another model's worker r1 is not this memory's";
  auto claimed = (*second)->Claim("m", "r0", a.ids);
  ASSERT_TRUE(claimed.has_value());
  EXPECT_EQ(claimed->writing, 2u);
  EXPECT_EQ(claimed->over, 1u);
  EXPECT_EQ(claimed->daemon_pid, ::getpid());
  EXPECT_EQ((*second)->leftovers(), 0u);
  EXPECT_EQ(CountFiles(dir), 2) << "r0's marker stays (still torn) and n1's is not n0's to touch";
  (*second)->Clear("r0");
  EXPECT_EQ(CountFiles(dir), 1);
  auto third = LiveMarkers::Open(dir, "n1");
  ASSERT_TRUE(third.ok());
  EXPECT_EQ((*third)->leftovers(), 1u);
}

// Stale (memory gone or replaced), corrupt, oversized and unfinished markers are dropped at
// Open, never crashing it.
TEST(LiveMarkersTest, StaleCorruptAndOversizedMarkersAreDropped) {
  const std::string dir = TempDir("stale");
  Segment a = MakeSegment();
  std::string gone_name;
  {
    auto m = LiveMarkers::Open(dir, "n0");
    ASSERT_TRUE(m.ok());
    Segment gone = MakeSegment();
    gone_name = gone.seg->name();
    ASSERT_TRUE((*m)->Record(MarkerFor("gone", gone)).ok());
    ASSERT_TRUE((*m)->Record(MarkerFor("alive", a)).ok());
    gone.seg->set_unlink_on_destroy(true);
  }
  (void)transport::ShmSegment::Unlink(gone_name);
  std::ofstream(dir + "/live-corrupt.marker") << "weightbridge-live-marker 1\nnonsense\n";
  std::ofstream(dir + "/live-huge.marker") << std::string(LiveMarkers::kMaxFileBytes + 1, 'x');
  std::ofstream(dir + "/live-0000000000000000.marker.tmp") << LiveMarkers::Serialize([&] {
    LiveMarker x = MarkerFor("half", a);
    x.node = "n0";
    return x;
  }());
  ::mkdir((dir + "/live-dir.marker").c_str(), 0700);
  auto m = LiveMarkers::Open(dir, "n0");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->leftovers(), 1u) << "only the marker of memory that still exists";
  EXPECT_TRUE((*m)->Claim("m", "alive", a.ids).has_value());
  EXPECT_EQ(CountFiles(dir), 2) << "alive's marker and the directory named like one remain";
}

TEST(LiveMarkersTest, DirectoryMustBePrivateAndAbsolute) {
  const std::string dir = TempDir("open");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  auto m = LiveMarkers::Open(dir, "n0");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("mode 0755"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find(dir), std::string::npos) << m.status();
  EXPECT_FALSE(LiveMarkers::Open("relative/dir", "n0").ok());
  const std::string link = dir + "-link";
  ASSERT_EQ(::symlink("/tmp", link.c_str()), 0);
  auto l = LiveMarkers::Open(link, "n0");
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("not a directory"), std::string::npos) << l.status();
  if (::geteuid() == 0) {
    // Owned by someone else (only root can make one here).
    const std::string theirs = dir + "-theirs";
    ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
    ASSERT_EQ(::chown(theirs.c_str(), 12345, 12345), 0);
    auto t = LiveMarkers::Open(theirs, "n0");
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("owned by uid 12345"), std::string::npos) << t.status();
  }
}

TEST(LiveMarkersTest, CountIsBounded) {
  const std::string dir = TempDir("count");
  auto m = LiveMarkers::Open(dir, "n0");
  ASSERT_TRUE(m.ok());
  Segment a = MakeSegment();
  for (size_t i = 0; i < LiveMarkers::kMaxMarkers; ++i) {
    ASSERT_TRUE((*m)->Record(MarkerFor("w" + std::to_string(i), a)).ok()) << i;
  }
  absl::Status s = (*m)->Record(MarkerFor("one-more", a));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("one-more"), std::string::npos) << s;
  EXPECT_TRUE((*m)->Record(MarkerFor("w0", a)).ok()) << "rewriting a worker's own marker is not one more";
}

}  // namespace
}  // namespace wb::daemon

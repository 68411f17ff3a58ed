#include "daemon/digest/checksum_fold.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace wb::digest {
namespace {

// ChecksumsOn over a command line (argv[0] = "weightbridged").
bool On(std::vector<std::string> args, bool digests, bool flag) {
  args.insert(args.begin(), "weightbridged");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return ChecksumsOn(static_cast<int>(argv.size()), argv.data(), digests, flag);
}

// weightbridged with digests on (the default) does not also checksum every batch unless asked.
TEST(ChecksumFoldTest, DigestsOnMeansNoPerBatchChecksumsUnlessAsked) {
  EXPECT_FALSE(On({}, true, false));
  EXPECT_FALSE(On({"--node_id=n1", "--digests"}, true, false));
  EXPECT_FALSE(On({"--digests=true", "--checksums_extra=1"}, true, false)) << "another flag's name";
  EXPECT_FALSE(On({"--", "--checksums"}, true, true)) << "after --: not a flag";
  EXPECT_TRUE(On({"--checksums"}, true, true));
  EXPECT_TRUE(On({"-checksums=true"}, true, true));
}

TEST(ChecksumFoldTest, DigestsOffMeansChecksumsUnlessTurnedOff) {
  EXPECT_TRUE(On({"--digests=false"}, false, false));
  EXPECT_FALSE(On({"--digests=false", "--checksums=false"}, false, false));
  EXPECT_FALSE(On({"--digests=false", "--nochecksums"}, false, false));
}

}  // namespace
}  // namespace wb::digest

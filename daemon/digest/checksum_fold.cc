#include "daemon/digest/checksum_fold.h"

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"

namespace wb::digest {

// This abseil keeps CommandLineFlag::IsSpecifiedOnCommandLine private: look at argv.
bool ChecksumsGiven(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (a == "--") break;
    if (!absl::ConsumePrefix(&a, "--") && !absl::ConsumePrefix(&a, "-")) continue;
    if (a == "checksums" || a == "nochecksums" || absl::StartsWith(a, "checksums=")) return true;
  }
  return false;
}

bool ChecksumsOn(int argc, char** argv, bool digests, bool checksums_flag) {
  return ChecksumsGiven(argc, argv) ? checksums_flag : !digests;
}

}  // namespace wb::digest

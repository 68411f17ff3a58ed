#include "bench/spec_files.h"

#include <dirent.h>

#include <algorithm>
#include <cstdlib>

namespace wb::bench {

std::string DefaultSpecsDir() {
  const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  return ws != nullptr ? std::string(ws) + "/examples/specs" : "examples/specs";
}

std::vector<std::string> JsonFiles(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.substr(n.size() - 5) == ".json") out.push_back(dir + "/" + n);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace wb::bench

// wbctl: the WeightBridge operator CLI. A small dispatcher: each subcommand lives in its own file
// pair (plan_command.{h,cc}, ...) and is registered in kCommands below.

#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "client/drain_command.h"
#include "client/layout_command.h"
#include "client/plan_command.h"
#include "client/status_command.h"
#include "client/watch_command.h"

namespace {

struct Command {
  const char* name;
  const char* help;
  int (*run)(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
};

const Command kCommands[] = {
    {"plan", "plan --spec FILE [--json]   plan a spec offline and print its figures",
     &wb::client::RunPlanCommand},
    {"status", "status --addr ADDR [--model ID] [--node ID] [--json]   nodes, workers, models, versions, last transfer",
     &wb::client::RunStatusCommand},
    {"watch", "watch --addr ADDR [--model ID] [--version V] [--timeout 300s] [--json]   live progress",
     &wb::client::RunWatchCommand},
    {"drain", "drain --addr ADDR [--node ID] [--timeout 60s]   finish in-flight work, refuse new",
     &wb::client::RunDrainCommand},
    {"versions", "versions --addr ADDR --model ID [--json]   a model's versions",
     &wb::client::RunVersionsCommand},
    {"layout", "layout (--config CONFIG.json | --addr unix:PATH --model ID) --preset P --rank R [--tp N ...] [--json]   "
               "a preset rank's buffer size and where each local tensor lives",
     &wb::client::RunLayoutCommand},
};

void Usage(std::ostream& os) {
  os << "usage: wbctl COMMAND [ARGS...]\ncommands:\n";
  for (const Command& c : kCommands) os << "  " << c.help << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage(std::cerr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "-h" || name == "--help" || name == "help") {
    Usage(std::cout);
    return 0;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  for (const Command& c : kCommands) {
    if (name == c.name) return c.run(args, std::cout, std::cerr);
  }
  std::cerr << "wbctl: unknown command '" << name << "'\n";
  Usage(std::cerr);
  return 2;
}

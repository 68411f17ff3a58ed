// weightbridged: flags and wiring only. (First cut: flags; the daemon issue wires the services.)
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tools/cc/gpu_info.h"

ABSL_FLAG(std::string, role, "standalone", "node | coordinator | standalone");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address (port 0 = pick one)");
ABSL_FLAG(std::string, port_file, "", "write the chosen port here once listening");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("WeightBridge daemon: weightbridged --role=node|coordinator|standalone");
  absl::ParseCommandLine(argc, argv);
  wb::GpuInfo gpu = wb::ProbeGpus();
  std::printf("weightbridged role=%s gpus=%d (%s)\n", absl::GetFlag(FLAGS_role).c_str(),
              gpu.device_count, gpu.unavailable_reason.c_str());
  return 0;
}

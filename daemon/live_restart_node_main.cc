// TEST ONLY: a node daemon process (daemon/server.h, role node, host transports) for
// live_restart_test, with one hook the real binary lacks: --stall_at=LABEL holds the live copy
// labelled LABEL (daemon/node/live_copy.h FaultHook labels, e.g. "apply r1 v2 midway": half of the
// copy landed) after writing one byte to --stalled_fd, until the process is killed. --ready_fd gets
// one byte once the node registered with the coordinator and serves its worker socket.
#include <signal.h>
#include <unistd.h>

#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/server.h"
#include "transport/factory.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator host:port");
ABSL_FLAG(std::string, node_id, "n1", "node id");
ABSL_FLAG(std::string, worker_socket, "", "Unix socket for workers");
ABSL_FLAG(std::string, live_state_dir, "", "NodeDaemon::Options::live_state_dir");
ABSL_FLAG(std::string, stall_at, "", "live-copy label to hold until killed");
ABSL_FLAG(int, stalled_fd, -1, "gets one byte when the copy is held");
ABSL_FLAG(int, ready_fd, -1, "gets one byte when the node is up");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  wb::daemon::ServerOptions o;
  o.role = wb::daemon::DaemonRole::kNode;
  o.node_id = absl::GetFlag(FLAGS_node_id);
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.worker_socket = absl::GetFlag(FLAGS_worker_socket);
  o.heartbeat = absl::Milliseconds(100);
  o.live_state_dir = absl::GetFlag(FLAGS_live_state_dir);
  o.make_transports = [] {
    wb::transport::TransportConfig tc;
    tc.kinds = {"host_shm", "host_tcp"};
    return wb::transport::CreateTransports(tc);
  };
  const std::string stall_at = absl::GetFlag(FLAGS_stall_at);
  const int stalled_fd = absl::GetFlag(FLAGS_stalled_fd);
  auto never = std::make_shared<absl::Notification>();
  o.configure_node = [&](wb::daemon::NodeDaemon::Options& no) {
    if (stall_at.empty()) return;
    no.test_live_copy_fault = [stall_at, stalled_fd, never](const std::string& label) {
      if (label == stall_at) {
        char b = 's';
        (void)!::write(stalled_fd, &b, 1);
        never->WaitForNotificationWithTimeout(absl::Minutes(5));  // the test kills us here
      }
      return absl::OkStatus();
    };
  };
  auto server = wb::daemon::Server::Start(o);
  if (!server.ok()) {
    fprintf(stderr, "live_restart_node: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  if (const int fd = absl::GetFlag(FLAGS_ready_fd); fd >= 0) {
    char b = 'r';
    (void)!::write(fd, &b, 1);
  }
  // Until SIGTERM (the test ends) or 5 minutes.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  struct timespec limit = {300, 0};
  (void)sigtimedwait(&set, nullptr, &limit);
  (*server)->Shutdown();
  return 0;
}

#include "tests/common/conn_flooder.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

namespace wb {

void ConnFlooder::Start(int port, int sources, int per_source) {
  int ready[2], stop[2];
  if (pipe2(ready, O_CLOEXEC) != 0 || pipe2(stop, O_CLOEXEC) != 0) std::abort();
  pid_ = fork();
  if (pid_ == 0) {
    close(ready[0]);
    close(stop[1]);
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;  // the child's own limit: enough for the whole flood
    setrlimit(RLIMIT_NOFILE, &rl);
    int32_t opened = 0;
    for (int s = 0; s < sources; ++s) {
      for (int i = 0; i < per_source; ++i) {
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (fd < 0) break;
        sockaddr_in src{};
        src.sin_family = AF_INET;
        src.sin_addr.s_addr = htonl(0x7f000002 + s);
        sockaddr_in dst{};
        dst.sin_family = AF_INET;
        dst.sin_port = htons(static_cast<uint16_t>(port));
        dst.sin_addr.s_addr = htonl(0x7f000001);
        if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
          close(fd);
          continue;
        }
        (void)!connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst));
        ++opened;
      }
    }
    pollfd p = {stop[0], POLLIN, 0};
    (void)poll(&p, 1, 500);  // let the handshakes complete
    (void)!write(ready[1], &opened, sizeof(opened));
    char c;
    (void)!read(stop[0], &c, 1);  // until the parent closes its end (or dies)
    _exit(0);                     // closes every flood connection
  }
  close(ready[1]);
  close(stop[0]);
  ready_r_ = ready[0];
  stop_w_ = stop[1];
}

int32_t ConnFlooder::WaitReady() {
  int32_t opened = 0;
  return read(ready_r_, &opened, sizeof(opened)) == sizeof(opened) ? opened : -1;
}

void ConnFlooder::Stop() {
  if (pid_ <= 0) return;
  close(stop_w_);
  close(ready_r_);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

}  // namespace wb

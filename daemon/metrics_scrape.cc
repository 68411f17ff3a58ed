#include "daemon/metrics_scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace wb::daemon {

absl::StatusOr<std::map<std::string, double>> ScrapeMetrics(int port, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{};
  tv.tv_sec = static_cast<long>(absl::ToInt64Seconds(timeout)) + 1;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", std::strerror(errno)));
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return absl::UnavailableError("send");
  }
  std::string body;
  char buf[16384];
  for (;;) {
    if (absl::Now() > deadline) {
      ::close(fd);
      return absl::DeadlineExceededError("scrape timed out");
    }
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    body.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (!absl::StartsWith(body, "HTTP/1.") || body.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("bad response: ", body.substr(0, 200)));
  }
  std::map<std::string, double> out;
  size_t start = body.find("\r\n\r\n");
  for (absl::string_view line : absl::StrSplit(absl::string_view(body).substr(start == std::string::npos ? 0 : start + 4), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    size_t sp = line.rfind(' ');
    if (sp == absl::string_view::npos) continue;
    double v = 0;
    if (!absl::SimpleAtod(line.substr(sp + 1), &v)) continue;
    out[std::string(line.substr(0, sp))] = v;
  }
  return out;
}

double MetricValue(const std::map<std::string, double>& samples, const std::string& series) {
  auto it = samples.find(series);
  return it == samples.end() ? -1 : it->second;
}

double MetricSum(const std::map<std::string, double>& samples, const std::string& name, const std::string& must_contain) {
  double sum = 0;
  for (auto& [k, v] : samples) {
    if ((absl::StartsWith(k, name + "{") || k == name) && absl::StrContains(k, must_contain)) sum += v;
  }
  return sum;
}

}  // namespace wb::daemon

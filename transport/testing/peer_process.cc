#include "transport/testing/peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/wire.h"

namespace wb::transport {

std::string HexEncode(absl::string_view bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

absl::StatusOr<std::string> HexDecode(absl::string_view hex) {
  if (hex.size() % 2) return absl::InvalidArgumentError("odd hex length");
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = v(hex[2 * i]), lo = v(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("bad hex digit");
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  return out;
}

namespace {
void PutSide(wire::Writer& w, const StridedRef& r) {
  w.I64(r.offset_bytes);
  w.U32(r.strides.size());
  for (auto s : r.strides) w.I64(s);
}
void GetSide(wire::Reader& r, StridedRef* s) {
  s->offset_bytes = r.I64();
  uint32_t n = r.U32();
  for (uint32_t i = 0; i < n && r.ok() && i < 64; ++i) s->strides.push_back(r.I64());
}
}  // namespace

std::string EncodeMirror(const MirrorBatch& m) {
  wire::Writer w;
  w.U64(m.tag);
  w.U8(m.checksum);
  w.U32(m.ops.size());
  for (const auto& o : m.ops) {
    w.U8(o.src_is_peer);
    w.U32(o.op.element_size);
    w.U32(o.op.shape.size());
    for (auto d : o.op.shape) w.I64(d);
    PutSide(w, o.op.src);
    PutSide(w, o.op.dst);
  }
  return std::move(w.out());
}

absl::StatusOr<MirrorBatch> DecodeMirror(absl::string_view bytes) {
  wire::Reader r(bytes);
  MirrorBatch m;
  m.tag = r.U64();
  m.checksum = r.U8();
  uint32_t n = r.U32();
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    MirrorBatch::Op o;
    o.src_is_peer = r.U8();
    o.op.element_size = r.U32();
    uint32_t rank = r.U32();
    for (uint32_t d = 0; d < rank && r.ok() && d < 64; ++d) o.op.shape.push_back(r.I64());
    GetSide(r, &o.op.src);
    GetSide(r, &o.op.dst);
    m.ops.push_back(std::move(o));
  }
  if (!r.done()) return absl::InvalidArgumentError("bad mirror batch encoding");
  return m;
}

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Spawn(const std::string& binary,
                                                                const std::vector<std::string>& args) {
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0 || pipe2(out_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  std::vector<std::string> argv_s = {binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  // A peer that already exited turns our next write into SIGPIPE, which would kill the test
  // process without a word; as an EPIPE error Send reports it instead.
  signal(SIGPIPE, SIG_IGN);
  auto p = std::unique_ptr<PeerProcess>(new PeerProcess());
  p->pid_ = pid;
  p->to_child_ = in_pipe[1];
  p->from_child_ = out_pipe[0];
  return p;
}

PeerProcess::~PeerProcess() {
  if (pid_ > 0) {
    (void)Send("QUIT");
    // Give it a moment to exit cleanly, then make sure.
    for (int i = 0; i < 200; ++i) {
      int st;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      struct pollfd pfd = {from_child_, POLLIN, 0};
      poll(&pfd, 1, 10);
      char buf[4096];
      if (pfd.revents) (void)!read(from_child_, buf, sizeof(buf));
    }
    if (pid_ > 0) Kill9();
  }
  if (to_child_ >= 0) close(to_child_);
  if (from_child_ >= 0) close(from_child_);
}

void PeerProcess::Kill9() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int st;
  waitpid(pid_, &st, 0);
  pid_ = -1;
}

absl::Status PeerProcess::Send(const std::string& line) {
  std::string l = line + "\n";
  size_t off = 0;
  while (off < l.size()) {
    ssize_t n = write(to_child_, l.data() + off, l.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("peer process ", pid_, " is gone (write: ", strerror(errno), ")"));
    off += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PeerProcess::Reply(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return ParseReplyLine(line);
    }
    int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError("peer process did not answer in time");
    struct pollfd pfd = {from_child_, POLLIN, 0};
    int r = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[65536];
    ssize_t n = read(from_child_, buf, sizeof(buf));
    if (n <= 0) return absl::UnavailableError(absl::StrCat("peer process ", pid_, " closed its stdout"));
    buffered_.append(buf, n);
  }
}

absl::StatusOr<std::string> ParseReplyLine(const std::string& line) {
  if (line.rfind("OK", 0) == 0) return line.size() > 3 ? line.substr(3) : "";
  if (line.rfind("ERR ", 0) == 0) {  // "ERR <absl status code> <message>"
    std::string rest = line.substr(4);
    size_t sp = rest.find(' ');
    int code = 0;
    if (sp != std::string::npos && absl::SimpleAtoi(rest.substr(0, sp), &code) && code > 0 && code < 17) {
      return absl::Status(static_cast<absl::StatusCode>(code), rest.substr(sp + 1));
    }
    return absl::InternalError(rest);
  }
  return absl::InternalError(absl::StrCat("peer sent garbage: ", line.substr(0, 200)));
}

absl::StatusOr<std::string> PeerProcess::Command(const std::string& line, absl::Duration timeout) {
  if (auto s = Send(line); !s.ok()) return s;
  return Reply(timeout);
}

}  // namespace wb::transport

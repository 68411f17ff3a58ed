#include "daemon/auth.h"

#include <fcntl.h>
#include <grpc/grpc_security_constants.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_posix.h>
#include <grpcpp/support/client_interceptor.h>
#include <grpcpp/support/server_interceptor.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "daemon/metrics.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

constexpr char kAuthHeader[] = "authorization";

std::string Errno(const std::string& what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

bool ConstantTimeEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kAuthHeader, value_});
    }
    methods->Proceed();
  }

 private:
  std::string value_;
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(value_);
  }

 private:
  std::string value_;
};

}  // namespace

uint64_t ProcessStartTime(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!f || !std::getline(f, line)) return 0;
  // comm (field 2) may contain spaces and parentheses: fields after the LAST ')' are fixed.
  size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<absl::string_view> fields = absl::StrSplit(absl::string_view(line).substr(close + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); start time is field 22 -> index 19.
  uint64_t t = 0;
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &t)) return 0;
  return t;
}

// ------------------------------------------------------------------------------ PeerCredListener
absl::StatusOr<std::unique_ptr<PeerCredListener>> PeerCredListener::Bind(const std::string& path, mode_t mode) {
  std::unique_ptr<PeerCredListener> l(new PeerCredListener());
  l->path_ = path;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("worker socket path '", path, "' is empty or longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  l->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l->listen_fd_ < 0) return absl::InternalError(Errno("socket"));
  ::unlink(path.c_str());  // a stale socket from a killed daemon
  // Create the socket file with no access at all, then open it up to `mode`: no window in which
  // a process outside the group could connect.
  mode_t old = ::umask(0777);
  int rc = ::bind(l->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old);
  if (rc != 0) return absl::UnavailableError(Errno(absl::StrCat("bind ", path)));
  if (::chmod(path.c_str(), mode) != 0) return absl::InternalError(Errno(absl::StrCat("chmod ", path)));
  if (::listen(l->listen_fd_, 128) != 0) return absl::UnavailableError(Errno(absl::StrCat("listen ", path)));
  l->stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (l->stop_fd_ < 0) return absl::InternalError(Errno("eventfd"));
  return l;
}

void PeerCredListener::Serve(grpc::Server* server) {
  server_ = server;
  thread_ = std::thread([this] { AcceptLoop(); });
}

PeerCredListener::~PeerCredListener() { Stop(); }

void PeerCredListener::Stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(path_.c_str());
  }
  if (stop_fd_ >= 0) {
    ::close(stop_fd_);
    stop_fd_ = -1;
  }
}

void PeerCredListener::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    ucred uc{};
    socklen_t len = sizeof(uc);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0) {
      ::close(fd);
      continue;
    }
    PeerCred cred{uc.pid, uc.uid, uc.gid, ProcessStartTime(uc.pid)};
    {
      // Recorded before gRPC sees the descriptor, so no call can arrive first. A number reused
      // after gRPC closed an older connection is simply overwritten.
      absl::MutexLock l(&mu_);
      by_fd_[fd] = cred;
    }
    grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns fd from here on
  }
}

absl::StatusOr<PeerCred> PeerCredListener::Lookup(const grpc::ServerContext& ctx) const {
  const std::string peer = ctx.peer();
  int fd = -1;
  if (!absl::StartsWith(peer, "fd:") || !absl::SimpleAtoi(absl::string_view(peer).substr(3), &fd)) {
    return absl::UnauthenticatedError(absl::StrCat("call from ", peer, " did not come through the worker socket"));
  }
  absl::MutexLock l(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return absl::UnauthenticatedError(absl::StrCat("no peer credentials for connection ", peer));
  return it->second;
}

// ------------------------------------------------------------------------------ GuardedWorkerService
GuardedWorkerService::GuardedWorkerService(pb::WorkerService::Service* inner, const PeerCredListener* peers, Limits limits,
                                           std::string node_id)
    : inner_(inner),
      peers_(peers),
      limits_(limits),
      node_id_(std::move(node_id)),
      blocked_(absl::StrCat("node ", node_id_, ": WorkerService.WaitVersion"), limits.max_blocked_calls) {}

grpc::Status GuardedWorkerService::Reject(const absl::Status& s, const std::string& what) {
  Metrics().Rejected(node_id_, what);
  return ToGrpcStatus(s);
}

absl::StatusOr<PeerCred> GuardedWorkerService::Caller(grpc::ServerContext* ctx) { return peers_->Lookup(*ctx); }

absl::Status GuardedWorkerService::CheckActsAs(grpc::ServerContext* ctx, const std::string& model, const std::string& worker) {
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return me.status();
  absl::MutexLock l(&mu_);
  auto it = bindings_.find(worker);
  if (it == bindings_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker, " is not registered on node ", node_id_, " (register again)"));
  }
  const Binding& b = it->second;
  if (b.cred.pid != me->pid || b.cred.start_time != me->start_time) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " belongs to process ", b.cred.pid, ", not to the caller (pid ",
                                                    me->pid, ")"));
  }
  if (b.model != model) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " is registered for model '", b.model, "', not '", model, "'"));
  }
  return absl::OkStatus();
}

absl::Status GuardedWorkerService::CheckBound(const PeerCred& sender, const std::string& model, const std::string& worker) {
  absl::MutexLock l(&mu_);
  auto it = bindings_.find(worker);
  if (it == bindings_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker, " is not registered on node ", node_id_, " (RegisterWorker first)"));
  }
  const Binding& b = it->second;
  if (b.cred.pid != sender.pid || b.cred.start_time != sender.start_time || b.cred.uid != sender.uid) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " belongs to process ", b.cred.pid, " (uid ", b.cred.uid,
                                                    "), not to the sender"));
  }
  if (b.model != model) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker, " is registered for model '", b.model, "', not '", model, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PeerCred> GuardedWorkerService::BoundCred(const std::string& worker) {
  absl::MutexLock l(&mu_);
  auto it = bindings_.find(worker);
  if (it == bindings_.end()) return absl::NotFoundError(absl::StrCat("worker ", worker, " is not registered on node ", node_id_));
  return it->second.cred;
}

grpc::Status GuardedWorkerService::RegisterWorker(grpc::ServerContext* ctx, const pb::RegisterWorkerRequest* req,
                                                  pb::RegisterWorkerResponse* resp) {
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return Reject(me.status(), "unauthenticated");
  for (auto [what, id] : {std::pair{"model_id", &req->model_id()}, std::pair{"worker_id", &req->worker_id()}}) {
    if (absl::Status s = CheckId(what, *id, limits_); !s.ok()) return Reject(s, "limit");
  }
  if (req->has_model()) {
    if (absl::Status s = CheckModelSpec(req->model(), limits_); !s.ok()) return Reject(s, "limit");
  }
  {
    absl::MutexLock l(&mu_);
    auto it = bindings_.find(req->worker_id());
    if (it != bindings_.end() && it->second.cred.pid != me->pid) {
      const PeerCred& owner = it->second.cred;
      // A restarted worker takes its id over from its dead predecessor; a live owner keeps it.
      if (ProcessStartTime(owner.pid) == owner.start_time && owner.start_time != 0) {
        return Reject(absl::PermissionDeniedError(absl::StrCat("worker id ", req->worker_id(), " is held by live process ", owner.pid)),
                      "impersonation");
      }
    }
  }
  // The node daemon watches the worker's process (kill -9 detection). A worker that names no pid
  // is watched through the kernel's word for it (SO_PEERCRED); one that names another (a launcher
  // registering for its engine process) keeps its choice - it can only get itself dropped.
  pb::RegisterWorkerRequest with_pid = *req;
  if (with_pid.pid() <= 0) with_pid.set_pid(static_cast<int32_t>(me->pid));
  grpc::Status s = inner_->RegisterWorker(ctx, &with_pid, resp);
  if (s.ok()) {
    absl::MutexLock l(&mu_);
    bindings_[req->worker_id()] = Binding{*me, req->model_id()};
  }
  return s;
}

grpc::Status GuardedWorkerService::RegisterLayout(grpc::ServerContext* ctx, const pb::RegisterLayoutRequest* req,
                                                  pb::RegisterLayoutResponse* resp) {
  if (absl::Status s = CheckActsAs(ctx, req->model_id(), req->worker_id()); !s.ok()) return Reject(s, "impersonation");
  if (absl::Status s = CheckLayoutRequest(req->buffers(), req->layout(), limits_); !s.ok()) {
    return Reject(absl::Status(s.code(), absl::StrCat("worker ", req->worker_id(), ": ", s.message())), "limit");
  }
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return Reject(me.status(), "unauthenticated");
  // Memory must belong to the caller's uid: fstat of the opened descriptor (no TOCTOU on names).
  for (const pb::BufferSpec& b : req->buffers()) {
    if (b.memory_case() != pb::BufferSpec::kShmName) continue;  // CUDA IPC: the handle is the capability
    const std::string& name = b.shm_name();
    if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 255) {
      return Reject(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": bad shm name '", name, "'")), "invalid");
    }
    // O_NONBLOCK: a FIFO named as a segment would block this open until a writer came (NODE helper, issue 15.9).
    int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) {
      return Reject(absl::NotFoundError(absl::StrCat("buffer ", b.buffer_id(), ": cannot open shm ", name, ": ", std::strerror(errno))),
                    "invalid");
    }
    struct stat st {};
    int rc = ::fstat(fd, &st);
    ::close(fd);
    if (rc != 0) return Reject(absl::InternalError(Errno(absl::StrCat("fstat shm ", name))), "invalid");
    if (!S_ISREG(st.st_mode)) {
      return Reject(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " is not a regular file (",
                                                            S_ISFIFO(st.st_mode) ? "a FIFO" : "not shared memory", ")")),
                    "invalid");
    }
    if (st.st_uid != me->uid) {
      return Reject(absl::PermissionDeniedError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " is owned by uid ", st.st_uid,
                                                             ", not by the caller's uid ", me->uid)),
                    "foreign_memory");
    }
    if (static_cast<uint64_t>(st.st_size) < b.size_bytes()) {
      return Reject(absl::InvalidArgumentError(absl::StrCat("buffer ", b.buffer_id(), ": shm ", name, " has ", st.st_size,
                                                            " bytes, fewer than size_bytes ", b.size_bytes())),
                    "invalid");
    }
  }
  return inner_->RegisterLayout(ctx, req, resp);
}

grpc::Status GuardedWorkerService::Publish(grpc::ServerContext* ctx, const pb::PublishRequest* req, pb::PublishResponse* resp) {
  if (absl::Status s = CheckActsAs(ctx, req->model_id(), req->worker_id()); !s.ok()) return Reject(s, "impersonation");
  {
    // Concurrent versions: each one pins a snapshot of this trainer and staging on every node.
    absl::MutexLock l(&mu_);
    // Looked up again: the binding may have gone since CheckActsAs released mu_ (a Deregister in
    // between; .at() threw, and the caller saw UNKNOWN "Unexpected error in RPC handling").
    auto bound = bindings_.find(req->worker_id());
    if (bound == bindings_.end()) {
      return Reject(absl::NotFoundError(absl::StrCat("worker ", req->worker_id(), " was deregistered on node ", node_id_,
                                                     " while it published version ", req->version(), " (register again)")),
                    "impersonation");
    }
    Binding& b = bound->second;
    const uint64_t committed = committed_[req->model_id()];
    for (auto it = b.pending.begin(); it != b.pending.end() && *it <= committed;) it = b.pending.erase(it);
    if (!b.pending.count(req->version()) && static_cast<int>(b.pending.size()) >= limits_.max_concurrent_versions) {
      return Reject(absl::ResourceExhaustedError(absl::StrCat("worker ", req->worker_id(), " has ", b.pending.size(),
                                                              " versions published and not yet committed (limit ",
                                                              limits_.max_concurrent_versions, "); wait for one")),
                    "limit");
    }
    b.pending.insert(req->version());
  }
  grpc::Status s = inner_->Publish(ctx, req, resp);
  if (!s.ok()) {
    absl::MutexLock l(&mu_);
    auto it = bindings_.find(req->worker_id());
    if (it != bindings_.end()) it->second.pending.erase(req->version());
  }
  if (s.ok()) {
    Metrics().Version(node_id_, req->model_id(), "published");
    Metrics().Phase(node_id_, "publish_stall", resp->stall_seconds());
  } else {
    Metrics().Failure(node_id_, FromGrpcStatus(s));
  }
  return s;
}

grpc::Status GuardedWorkerService::BeginUpdate(grpc::ServerContext* ctx, const pb::BeginUpdateRequest* req,
                                               pb::BeginUpdateResponse* resp) {
  if (absl::Status s = CheckActsAs(ctx, req->model_id(), req->worker_id()); !s.ok()) return Reject(s, "impersonation");
  return inner_->BeginUpdate(ctx, req, resp);
}

grpc::Status GuardedWorkerService::Apply(grpc::ServerContext* ctx, const pb::ApplyRequest* req, pb::ApplyResponse* resp) {
  if (absl::Status s = CheckActsAs(ctx, req->model_id(), req->worker_id()); !s.ok()) return Reject(s, "impersonation");
  grpc::Status s = inner_->Apply(ctx, req, resp);
  if (s.ok()) {
    uint64_t committed = 0;
    {
      absl::MutexLock l(&mu_);
      committed = committed_[req->model_id()];
    }
    Metrics().Version(node_id_, req->model_id(), "applied");
    Metrics().Phase(node_id_, "apply", resp->stall_seconds());
    Metrics().Applied(node_id_, req->model_id(), req->worker_id(), resp->applied_version(), committed);
  }
  return s;
}

grpc::Status GuardedWorkerService::WaitVersion(grpc::ServerContext* ctx, const pb::WaitVersionRequest* req,
                                               pb::WaitVersionResponse* resp) {
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return Reject(me.status(), "unauthenticated");
  {
    absl::MutexLock l(&mu_);
    bool member = false;
    for (auto& [id, b] : bindings_) member |= b.cred.pid == me->pid && b.model == req->model_id();
    if (!member) {
      return Reject(absl::PermissionDeniedError(absl::StrCat("the caller (pid ", me->pid, ") has no worker of model '", req->model_id(),
                                                             "' on node ", node_id_)),
                    "impersonation");
    }
  }
  absl::StatusOr<BlockedCalls::Slot> slot = blocked_.Acquire();
  if (!slot.ok()) return Reject(slot.status(), "blocked_calls");
  return inner_->WaitVersion(ctx, req, resp);
}

grpc::Status GuardedWorkerService::Deregister(grpc::ServerContext* ctx, const pb::DeregisterRequest* req, pb::DeregisterResponse* resp) {
  if (absl::Status s = CheckActsAs(ctx, req->model_id(), req->worker_id()); !s.ok()) return Reject(s, "impersonation");
  grpc::Status s = inner_->Deregister(ctx, req, resp);
  {
    absl::MutexLock l(&mu_);
    bindings_.erase(req->worker_id());
  }
  if (on_deregister_) on_deregister_(req->worker_id());
  return s;
}

grpc::Status GuardedWorkerService::Status(grpc::ServerContext* ctx, const pb::StatusRequest* req, pb::StatusResponse* resp) {
  // Anyone allowed onto the socket (mode 0660) may read status.
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return Reject(me.status(), "unauthenticated");
  return inner_->Status(ctx, req, resp);
}

grpc::Status GuardedWorkerService::DescribeLayout(grpc::ServerContext* ctx, const pb::DescribeLayoutRequest* req,
                                                  pb::DescribeLayoutResponse* resp) {
  // Computes from the request alone (no worker's memory involved), like Status: any caller
  // allowed onto the socket, within the limits a registration would have to meet.
  absl::StatusOr<PeerCred> me = Caller(ctx);
  if (!me.ok()) return Reject(me.status(), "unauthenticated");
  if (absl::Status s = CheckId("model_id", req->model_id(), limits_); !s.ok()) return Reject(s, "limit");
  if (req->has_model()) {
    if (absl::Status s = CheckModelSpec(req->model(), limits_); !s.ok()) return Reject(s, "limit");
  }
  // No memory yet: the buffers are the ids the pieces name (a worker may have max_buffers_per_worker).
  google::protobuf::RepeatedPtrField<pb::BufferSpec> named;
  std::set<uint32_t> ids;
  for (const pb::Piece& p : req->layout().pieces().pieces()) {
    for (uint32_t id : {p.buffer_id(), p.scale_buffer_id()}) {
      if (ids.insert(id).second) {
        pb::BufferSpec* b = named.Add();
        b->set_buffer_id(id);
        b->set_size_bytes(1);
      }
    }
  }
  if (absl::Status s = CheckLayoutRequest(named, req->layout(), limits_); !s.ok()) return Reject(s, "limit");
  return inner_->DescribeLayout(ctx, req, resp);
}

void GuardedWorkerService::NoteCommitted(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  uint64_t& c = committed_[model];
  c = std::max(c, version);
}

void GuardedWorkerService::NoteAborted(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto& [id, b] : bindings_) {
    if (b.model == model) b.pending.erase(version);
  }
}

absl::StatusOr<BlockedCalls::Slot> BlockedCalls::Acquire() {
  const int was = in_use_.fetch_add(1);
  Slot slot(this);  // gives the count back on every path
  if (was >= limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(what_, ": ", was, " calls are already waiting (limit ", limit_,
                                                     ", --max_blocked_calls); retry later"));
  }
  return slot;
}

namespace {

class StatusMessageInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit StatusMessageInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INTERNAL,
            absl::StrCat(method_, ": the request could not be parsed as this method's request message (not a protobuf of that "
                                  "type, or truncated)")));
      }
    }
    methods->Proceed();
  }

 private:
  std::string method_;
};

class StatusMessageInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new StatusMessageInterceptor(info->method() != nullptr ? info->method() : "?");
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStatusMessageInterceptor() {
  return std::make_unique<StatusMessageInterceptorFactory>();
}

// ------------------------------------------------------------------------------ daemon <-> daemon
absl::StatusOr<PeerAuthConfig> LoadPeerAuth(const std::string& cert_path, const std::string& key_path, const std::string& ca_path,
                                            const std::string& token_path) {
  PeerAuthConfig c;
  const int given = !cert_path.empty() + !key_path.empty() + !ca_path.empty();
  if (given != 0 && given != 3) {
    return absl::InvalidArgumentError("--tls_cert, --tls_key and --tls_ca must be given together");
  }
  if (given == 3) {
    auto cert = ReadFile("tls_cert", cert_path);
    if (!cert.ok()) return cert.status();
    auto key = ReadFile("tls_key", key_path);
    if (!key.ok()) return key.status();
    auto ca = ReadFile("tls_ca", ca_path);
    if (!ca.ok()) return ca.status();
    c.tls_cert_pem = std::move(*cert);
    c.tls_key_pem = std::move(*key);
    c.tls_ca_pem = std::move(*ca);
    for (auto [flag, pem] : {std::pair{"tls_cert", &c.tls_cert_pem}, std::pair{"tls_key", &c.tls_key_pem}, std::pair{"tls_ca", &c.tls_ca_pem}}) {
      if (pem->find("-----BEGIN") == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": not a PEM file"));
    }
  }
  if (!token_path.empty()) {
    auto token = ReadFile("auth_token_file", token_path);
    if (!token.ok()) return token.status();
    c.token = std::string(absl::StripAsciiWhitespace(*token));
    if (c.token.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth_token_file ", token_path, " is empty"));
    for (unsigned char ch : c.token) {
      if (ch < 0x21 || ch > 0x7e) return absl::InvalidArgumentError("--auth_token_file: the token must be printable ASCII without spaces");
    }
  }
  return c;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const PeerAuthConfig& config) {
  if (!config.tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  // Certificates are verified when presented; a peer presenting none gets through the handshake
  // only to be refused with UNAUTHENTICATED by CheckPeer (a clearer error than a failed handshake).
  o.pem_root_certs = config.tls_ca_pem;
  o.pem_key_cert_pairs.push_back({config.tls_key_pem, config.tls_cert_pem});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<grpc::Channel> MakePeerChannel(const std::string& target, const PeerAuthConfig& config,
                                               int64_t max_message_bytes) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  if (max_message_bytes > 0) {
    const int bytes = static_cast<int>(std::min<int64_t>(max_message_bytes, INT32_MAX));
    args.SetMaxReceiveMessageSize(bytes);
    args.SetMaxSendMessageSize(bytes);
  }
  if (config.tls()) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = config.tls_ca_pem;
    o.pem_private_key = config.tls_key_pem;
    o.pem_cert_chain = config.tls_cert_pem;
    creds = grpc::SslCredentials(o);
    if (!config.tls_server_name.empty()) args.SetSslTargetNameOverride(config.tls_server_name);
  }
  // A restarted peer (coordinator) is reached within about a second, not after gRPC's default
  // exponential reconnect backoff (up to 2 minutes).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!config.token.empty()) interceptors.push_back(std::make_unique<TokenInterceptorFactory>(absl::StrCat("Bearer ", config.token)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(interceptors));
}

absl::Status CheckPeer(const grpc::ServerContext& ctx, const PeerAuthConfig& config) {
  if (config.tls()) {
    auto auth = ctx.auth_context();
    if (!auth || !auth->IsPeerAuthenticated()) {
      return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " presented no client certificate signed by the cluster CA"));
    }
  }
  if (!config.token.empty()) {
    const auto& md = ctx.client_metadata();
    auto it = md.find(kAuthHeader);
    if (it == md.end()) return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " sent no auth token"));
    absl::string_view got(it->second.data(), it->second.size());
    if (!absl::ConsumePrefix(&got, "Bearer ") || !ConstantTimeEqual(got, config.token)) {
      return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " sent a wrong auth token"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNodeIdentity(const grpc::ServerContext& ctx, const PeerAuthConfig& config, const std::string& node_id) {
  if (!config.tls() || !config.bind_node_id) return absl::OkStatus();
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " presented no client certificate signed by the cluster CA"));
  }
  std::vector<std::string> names;
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth->FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
  }
  for (const std::string& n : names) {
    if (n == node_id) return absl::OkStatus();
  }
  std::string shown = absl::StrJoin(names, ", ");
  if (shown.size() > 256) shown = shown.substr(0, 256) + "...";
  std::string id = node_id.size() > 128 ? node_id.substr(0, 128) + "..." : node_id;
  return absl::PermissionDeniedError(absl::StrCat("node id '", id, "' is not the identity of the caller's certificate (CN/SAN: ",
                                                  shown.empty() ? "none" : shown,
                                                  "): with mutual TLS a node may act only as the node its certificate names"));
}

// ------------------------------------------------------------------------------ TokenNodeService
TokenNodeService::TokenNodeService(pb::NodeService::Service* inner, std::shared_ptr<const PeerAuthConfig> config, std::string node_id,
                                   CommitHook on_commit, CommitHook on_abort, PeerAuthenticated on_authenticated)
    : inner_(inner),
      config_(std::move(config)),
      node_id_(std::move(node_id)),
      on_commit_(std::move(on_commit)),
      on_abort_(std::move(on_abort)),
      on_authenticated_(std::move(on_authenticated)) {}

grpc::Status TokenNodeService::Check(grpc::ServerContext* ctx) {
  absl::Status s = CheckPeer(*ctx, *config_);
  if (!s.ok()) Metrics().Rejected(node_id_, "unauthenticated");
  if (s.ok() && on_authenticated_) on_authenticated_(ctx->peer());
  return ToGrpcStatus(s);
}

grpc::Status TokenNodeService::InstallPlan(grpc::ServerContext* ctx, const pb::InstallPlanRequest* req, pb::InstallPlanResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->InstallPlan(ctx, req, resp);
}
grpc::Status TokenNodeService::ExecuteVersion(grpc::ServerContext* ctx, const pb::ExecuteVersionRequest* req,
                                              pb::ExecuteVersionResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->ExecuteVersion(ctx, req, resp);
}
grpc::Status TokenNodeService::CommitVersion(grpc::ServerContext* ctx, const pb::CommitVersionRequest* req,
                                             pb::CommitVersionResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  const absl::Time t0 = absl::Now();
  grpc::Status s = inner_->CommitVersion(ctx, req, resp);
  if (s.ok()) {
    Metrics().Phase(node_id_, "commit", absl::ToDoubleSeconds(absl::Now() - t0));
    Metrics().Version(node_id_, req->model_id(), "committed");
    Metrics().Committed(node_id_, req->model_id(), req->version());
    if (on_commit_) on_commit_(req->model_id(), req->version());
  }
  return s;
}
grpc::Status TokenNodeService::AbortVersion(grpc::ServerContext* ctx, const pb::AbortVersionRequest* req,
                                            pb::AbortVersionResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  Metrics().Version(node_id_, req->model_id(), "aborted");
  Metrics().Failure(node_id_, absl::AbortedError(req->reason()));
  if (on_abort_) on_abort_(req->model_id(), req->version());
  return inner_->AbortVersion(ctx, req, resp);
}
grpc::Status TokenNodeService::DropWorker(grpc::ServerContext* ctx, const pb::DropWorkerRequest* req, pb::DropWorkerResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->DropWorker(ctx, req, resp);
}
grpc::Status TokenNodeService::SetupDataChannel(grpc::ServerContext* ctx, const pb::SetupDataChannelRequest* req,
                                                pb::SetupDataChannelResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->SetupDataChannel(ctx, req, resp);
}
grpc::Status TokenNodeService::ExchangeRegions(grpc::ServerContext* ctx, const pb::ExchangeRegionsRequest* req,
                                               pb::ExchangeRegionsResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->ExchangeRegions(ctx, req, resp);
}
grpc::Status TokenNodeService::Drain(grpc::ServerContext* ctx, const pb::DrainRequest* req, pb::DrainResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->Drain(ctx, req, resp);
}
grpc::Status TokenNodeService::Status(grpc::ServerContext* ctx, const pb::StatusRequest* req, pb::StatusResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->Status(ctx, req, resp);
}

// ------------------------------------------------------------------------------ TokenCoordinatorService
TokenCoordinatorService::TokenCoordinatorService(pb::CoordinatorService::Service* inner, std::shared_ptr<const PeerAuthConfig> config,
                                                 Limits limits, PeerAuthenticated on_authenticated)
    : inner_(inner),
      config_(std::move(config)),
      limits_(limits),
      on_authenticated_(std::move(on_authenticated)),
      blocked_("coordinator: CoordinatorService.WaitVersion", limits.max_blocked_calls) {}

grpc::Status TokenCoordinatorService::Check(grpc::ServerContext* ctx) {
  absl::Status s = CheckPeer(*ctx, *config_);
  if (!s.ok()) Metrics().Rejected("coordinator", "unauthenticated");
  if (s.ok() && on_authenticated_) on_authenticated_(ctx->peer());
  return ToGrpcStatus(s);
}

grpc::Status TokenCoordinatorService::CheckNode(grpc::ServerContext* ctx, const std::string& node_id) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  absl::Status s = CheckNodeIdentity(*ctx, *config_, node_id);
  if (!s.ok()) Metrics().Rejected("coordinator", "impersonation");
  return ToGrpcStatus(s);
}

#define WB_COORD_CALL(Method, Req, Resp)                                                                    \
  grpc::Status TokenCoordinatorService::Method(grpc::ServerContext* ctx, const pb::Req* req, pb::Resp* resp) { \
    if (grpc::Status s = Check(ctx); !s.ok()) return s;                                                     \
    return inner_->Method(ctx, req, resp);                                                                  \
  }
// A call a node makes about itself: its node_id must be its certificate's (CheckNodeIdentity).
#define WB_COORD_NODE_CALL(Method, Req, Resp)                                                               \
  grpc::Status TokenCoordinatorService::Method(grpc::ServerContext* ctx, const pb::Req* req, pb::Resp* resp) { \
    if (grpc::Status s = CheckNode(ctx, req->node_id()); !s.ok()) return s;                                 \
    return inner_->Method(ctx, req, resp);                                                                  \
  }

WB_COORD_NODE_CALL(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
WB_COORD_NODE_CALL(Heartbeat, HeartbeatRequest, HeartbeatResponse)
WB_COORD_NODE_CALL(LeaveWorker, LeaveWorkerRequest, LeaveWorkerResponse)
WB_COORD_NODE_CALL(ReportReady, ReportReadyRequest, ReportReadyResponse)
WB_COORD_NODE_CALL(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
#undef WB_COORD_NODE_CALL
WB_COORD_CALL(ClusterStatus, StatusRequest, StatusResponse)
WB_COORD_CALL(Drain, DrainRequest, DrainResponse)
WB_COORD_CALL(Plan, PlanRequest, PlanResponse)
#undef WB_COORD_CALL

grpc::Status TokenCoordinatorService::WaitVersion(grpc::ServerContext* ctx, const pb::WaitVersionRequest* req,
                                                  pb::WaitVersionResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  absl::StatusOr<BlockedCalls::Slot> slot = blocked_.Acquire();
  if (!slot.ok()) {
    Metrics().Rejected("coordinator", "blocked_calls");
    return ToGrpcStatus(slot.status());
  }
  return inner_->WaitVersion(ctx, req, resp);
}

grpc::Status TokenCoordinatorService::WatchStatus(grpc::ServerContext* ctx, const pb::WatchStatusRequest* req,
                                                  grpc::ServerWriter<pb::StatusResponse>* writer) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  return inner_->WatchStatus(ctx, req, writer);
}

grpc::Status TokenCoordinatorService::CreateModel(grpc::ServerContext* ctx, const pb::CreateModelRequest* req,
                                                  pb::CreateModelResponse* resp) {
  if (grpc::Status s = Check(ctx); !s.ok()) return s;
  if (absl::Status s = CheckModelSpec(req->model(), limits_); !s.ok()) return ToGrpcStatus(s);
  return inner_->CreateModel(ctx, req, resp);
}
grpc::Status TokenCoordinatorService::JoinWorker(grpc::ServerContext* ctx, const pb::JoinWorkerRequest* req, pb::JoinWorkerResponse* resp) {
  if (grpc::Status s = CheckNode(ctx, req->node_id()); !s.ok()) return s;
  if (req->has_model()) {
    if (absl::Status s = CheckModelSpec(req->model(), limits_); !s.ok()) return ToGrpcStatus(s);
  }
  return inner_->JoinWorker(ctx, req, resp);
}
grpc::Status TokenCoordinatorService::SubmitLayout(grpc::ServerContext* ctx, const pb::SubmitLayoutRequest* req,
                                                   pb::SubmitLayoutResponse* resp) {
  if (grpc::Status s = CheckNode(ctx, req->node_id()); !s.ok()) return s;
  if (absl::Status s = CheckLayoutRequest(req->buffers(), req->layout(), limits_); !s.ok()) {
    return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("worker ", req->worker_id(), ": ", s.message())));
  }
  return inner_->SubmitLayout(ctx, req, resp);
}
grpc::Status TokenCoordinatorService::Publish(grpc::ServerContext* ctx, const pb::CoordPublishRequest* req, pb::PublishResponse* resp) {
  if (grpc::Status s = CheckNode(ctx, req->node_id()); !s.ok()) return s;
  return inner_->Publish(ctx, req, resp);
}
grpc::Status TokenCoordinatorService::ReportDone(grpc::ServerContext* ctx, const pb::ReportDoneRequest* req, pb::ReportDoneResponse* resp) {
  if (grpc::Status s = CheckNode(ctx, req->node_id()); !s.ok()) return s;
  if (req->ok()) {
    Metrics().Phase(req->node_id(), "transfer", req->seconds());
  } else {
    Metrics().Failure(req->node_id(), absl::AbortedError(req->error()));
  }
  return inner_->ReportDone(ctx, req, resp);
}

}  // namespace wb::daemon

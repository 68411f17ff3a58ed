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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
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

// A token file (--auth_token_file, --operator_token_file): surrounding whitespace trimmed, then
// non-empty printable ASCII without spaces. INVALID_ARGUMENT names the flag.
absl::StatusOr<std::string> ReadToken(const std::string& flag, const std::string& path) {
  auto raw = ReadFile(flag, path);
  if (!raw.ok()) return raw.status();
  std::string token(absl::StripAsciiWhitespace(*raw));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is empty"));
  for (unsigned char ch : token) {
    if (ch < 0x21 || ch > 0x7e) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": the token must be printable ASCII without spaces"));
  }
  return token;
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
  // A stale socket from a killed daemon is removed; a live daemon's is not taken over.
  if (absl::Status s = ClearStaleSocket(path, SOCK_STREAM, "worker socket"); !s.ok()) return s;
  // Create the socket file with no access at all, then open it up to `mode`: no window in which
  // a process outside the group could connect.
  mode_t old = ::umask(0777);
  int rc = ::bind(l->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old);
  if (rc != 0) return absl::UnavailableError(Errno(absl::StrCat("bind ", path)));
  l->bound_ = BoundSocketPath::Note(path);
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
    bound_.UnlinkIfStillOurs();  // not a socket another daemon bound at this path since
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

absl::StatusOr<PeerCred> PeerCredListener::Lookup(const grpc::ServerContextBase& ctx) const {
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

absl::StatusOr<BlockedCalls::Slot> BlockedCalls::Acquire(const std::string& key, const std::string& who) {
  absl::MutexLock l(&mu_);
  if (per_key_ > 0) {
    auto it = by_key_.find(key);
    const int held = it == by_key_.end() ? 0 : it->second;
    if (held >= per_key_) {
      return absl::ResourceExhaustedError(absl::StrCat(what_, ": ", who.empty() ? key : who, " already holds ", held,
                                                       " waiting calls (limit ", per_key_, " ", per_key_what_, "); retry later"));
    }
  }
  if (in_use_ >= limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(what_, ": ", in_use_, " calls are already waiting (limit ", limit_,
                                                     ", --max_blocked_calls); retry later"));
  }
  ++in_use_;
  ++by_key_[key];
  return Slot(this, key);
}

void BlockedCalls::Release(const std::string& key) {
  absl::MutexLock l(&mu_);
  --in_use_;
  auto it = by_key_.find(key);
  if (it != by_key_.end() && --it->second <= 0) by_key_.erase(it);
}

int BlockedCalls::in_use() const {
  absl::MutexLock l(&mu_);
  return in_use_;
}

int BlockedCalls::in_use(const std::string& key) const {
  absl::MutexLock l(&mu_);
  auto it = by_key_.find(key);
  return it == by_key_.end() ? 0 : it->second;
}

namespace {

class StatusMessageInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit StatusMessageInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status s = methods->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL && s.error_message().empty()) {
        methods->ModifySendStatus(ToGrpcStatus(absl::InternalError(
            absl::StrCat(method_, ": the request could not be parsed as this method's request message (not a protobuf of that "
                                  "type, or truncated)"))));
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

// Adds the operator token to CoordinatorService.Drain only: a node daemon forwards a Drain its own
// gate accepted (NodeService.Drain checks the operator credential first); no other call carries it.
class OperatorTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit OperatorTokenInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kOperatorTokenHeader, value_});
    }
    methods->Proceed();
  }

 private:
  std::string value_;
};

class OperatorTokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit OperatorTokenInterceptorFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo* info) override {
    if (info == nullptr || info->method() == nullptr || std::strcmp(info->method(), "/weightbridge.v1.CoordinatorService/Drain") != 0) {
      return nullptr;  // gRPC skips a factory that returns no interceptor
    }
    return new OperatorTokenInterceptor(value_);
  }

 private:
  std::string value_;
};

// The verified client certificate's CN and SANs (empty without one).
std::vector<std::string> CertificateNames(const grpc::ServerContextBase& ctx) {
  std::vector<std::string> names;
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return names;
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth->FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
  }
  return names;
}

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
    auto token = ReadToken("auth_token_file", token_path);
    if (!token.ok()) return token.status();
    c.token = std::move(*token);
  }
  return c;
}

absl::Status LoadOperatorCredential(const std::string& token_path, const std::string& names, PeerAuthConfig* config) {
  if (!token_path.empty()) {
    auto token = ReadToken("operator_token_file", token_path);
    if (!token.ok()) return token.status();
    std::string t = std::move(*token);
    if (!config->token.empty() && ConstantTimeEqual(t, config->token)) {
      return absl::InvalidArgumentError(
          "--operator_token_file holds the cluster token (--auth_token_file): every node has that one, so it cannot tell an operator "
          "apart; use a separate token");
    }
    config->operator_token = std::move(t);
  }
  config->operator_names.clear();
  for (absl::string_view n : absl::StrSplit(names, ',', absl::SkipWhitespace())) {
    config->operator_names.emplace_back(absl::StripAsciiWhitespace(n));
  }
  if (!config->operator_names.empty() && !config->tls()) {
    return absl::InvalidArgumentError("--operator_names names client certificates: it needs --tls_cert, --tls_key and --tls_ca");
  }
  return absl::OkStatus();
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
  if (!config.operator_token.empty()) interceptors.push_back(std::make_unique<OperatorTokenInterceptorFactory>(config.operator_token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(interceptors));
}

absl::Status CheckPeer(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config) {
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

absl::Status CheckNodeIdentity(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& node_id) {
  if (!config.tls() || !config.bind_node_id) return absl::OkStatus();
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " presented no client certificate signed by the cluster CA"));
  }
  const std::vector<std::string> names = CertificateNames(ctx);
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

absl::Status CheckCoordinatorIdentity(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& method) {
  if (!config.tls() || !config.bind_node_id || config.coordinator_identity.empty()) return absl::OkStatus();
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError(absl::StrCat("peer ", ctx.peer(), " presented no client certificate signed by the cluster CA"));
  }
  const std::string& want = config.coordinator_identity;
  const std::vector<std::string> names = CertificateNames(ctx);
  for (const std::string& n : names) {
    if (n == want) return absl::OkStatus();
    // "*.example.com" names exactly one more label, as the TLS host check allows it.
    const size_t dot = want.find('.');
    if (n.size() > 2 && n[0] == '*' && n[1] == '.' && dot != std::string::npos && dot > 0 && want.substr(dot) == n.substr(1)) {
      return absl::OkStatus();
    }
  }
  std::string shown = absl::StrJoin(names, ", ");
  if (shown.size() > 256) shown = shown.substr(0, 256) + "...";
  return absl::PermissionDeniedError(absl::StrCat("NodeService.", method, " is the coordinator's call: the caller's certificate (CN/SAN: ",
                                                  shown.empty() ? "none" : shown, ") does not name the coordinator '", want,
                                                  "' (--tls_server_name, else the host of --coordinator)"));
}

absl::Status CheckOperator(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& action) {
  if (!config.operator_required()) return absl::OkStatus();
  bool sent_token = false;
  if (!config.operator_token.empty()) {
    const auto& md = ctx.client_metadata();
    auto it = md.find(kOperatorTokenHeader);
    if (it != md.end()) {
      sent_token = true;
      if (ConstantTimeEqual(absl::string_view(it->second.data(), it->second.size()), config.operator_token)) return absl::OkStatus();
    }
  }
  std::vector<std::string> names;
  if (config.tls() && !config.operator_names.empty()) {
    names = CertificateNames(ctx);
    for (const std::string& n : names) {
      for (const std::string& op : config.operator_names) {
        if (n == op) return absl::OkStatus();
      }
    }
  }
  std::string how;
  if (!config.operator_token.empty()) {
    how = sent_token ? "the operator token sent is wrong" : "send the operator token (wbctl --operator_token_file; header x-wb-operator-token)";
  }
  if (!config.operator_names.empty()) {
    std::string shown = absl::StrJoin(names, ", ");
    if (shown.size() > 256) shown = shown.substr(0, 256) + "...";
    absl::StrAppend(&how, how.empty() ? "" : ", or ", "call with a client certificate naming one of --operator_names (the caller's: ",
                    shown.empty() ? "none" : shown, ")");
  }
  return absl::PermissionDeniedError(absl::StrCat(action, " needs the operator credential: ", how));
}

std::string PeerKey(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config) {
  if (config.tls()) {
    auto auth = ctx.auth_context();
    if (auth && auth->IsPeerAuthenticated()) {
      for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
        for (const grpc::string_ref& v : auth->FindPropertyValues(property)) {
          std::string name(v.data(), std::min<size_t>(v.size(), 256));
          return absl::StrCat("node ", name, " (certificate)");
        }
      }
    }
  }
  return absl::StrCat("the connection ", ctx.peer(), " (no TLS: nodes told apart by connection)");
}

std::string TargetHost(const std::string& target) {
  std::string t = target;
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (t.rfind(scheme, 0) == 0) {
      t = t.substr(std::string(scheme).size());
      break;
    }
  }
  if (!t.empty() && t[0] == '[') {
    const size_t close = t.find(']');
    return close == std::string::npos ? t : t.substr(1, close - 1);
  }
  const size_t colon = t.rfind(':');
  return colon == std::string::npos ? t : t.substr(0, colon);
}

}  // namespace wb::daemon

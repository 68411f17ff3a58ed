#pragma once
// One server interceptor that checks every call against a per-method policy table, and the one
// place where handlers are called that lets through only the calls it passed.
//
// Why two halves: a gRPC C++ server interceptor (1.51, the Debian package) sees a call's metadata
// and its deserialized request (POST_RECV_MESSAGE) and its reply status (PRE_SEND_STATUS), but it
// cannot answer a call itself: Hijack() is client-only (grpc/grpc#24017), so the handler would run
// anyway. The interceptor therefore records its verdict in the AuthGate, and AuthGate::Guard(svc)
// registers, in place of `svc`, a service with the same methods whose handlers first take that
// verdict: a call the interceptor refused (or never saw) is answered with the refusal and the
// service's handler does not run. No per-RPC code: the methods are read from the protobuf
// service descriptor and the service's own handlers are reused.
//
// Policies (daemon/auth_policy.h) say per method what is checked; a method of a guarded service
// with no rule is refused (a new RPC is closed until someone writes its rule). Methods of services
// the gate does not guard (grpc.health.v1) are not checked.

#include <deque>
#include <vector>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <google/protobuf/descriptor.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/auth.h"

namespace grpc {
class ServerContextBase;
class Service;
namespace experimental {
class ServerInterceptorFactoryInterface;
}  // namespace experimental
}  // namespace grpc


namespace wb::daemon {

// One call as a rule sees it. Lives from the call's arrival to its end.
struct AuthCall {
  grpc::ServerContextBase* ctx = nullptr;
  std::string method;  // "/weightbridge.v1.NodeService/CommitVersion"
  // Set by a rule: run once the handler's status is known, before the reply leaves. `response`
  // is the handler's response message (null when the call failed or streams).
  std::function<void(const grpc::Status& status, const void* response)> after;
  // Held until the handler returns (BlockedCalls).
  std::optional<BlockedCalls::Slot> slot;
};

// A rule's answer. `what` labels wb_rejected_total{what} when refused (empty: not counted).
struct Verdict {
  absl::Status status;
  std::string what;
  static Verdict Ok() { return {}; }
};

// request: the deserialized request message (the method's request type; a rule may modify it
// before the handler sees it). Must be thread-safe.
using AuthRule = std::function<Verdict(AuthCall& call, void* request)>;

// Typed rule for a method whose request type is Req.
template <typename Req>
AuthRule Rule(std::function<Verdict(AuthCall&, Req&)> f) {
  return [f = std::move(f)](AuthCall& call, void* request) { return f(call, *static_cast<Req*>(request)); };
}

class AuthGate {
 public:
  // `on_refused(method, what)` counts a refusal (wb_rejected_total); may be empty.
  using RefusalCounter = std::function<void(const std::string& method, const std::string& what)>;
  explicit AuthGate(RefusalCounter on_refused);
  ~AuthGate();
  AuthGate(const AuthGate&) = delete;
  AuthGate& operator=(const AuthGate&) = delete;

  // Adds the rule for `method` ("/pkg.Service/Method"). Before the server starts.
  void Add(const std::string& method, AuthRule rule);
  // A service with `inner`'s methods (from `descriptor`) whose handlers run only for calls the
  // interceptor passed; register it instead of `inner`. Owned by the gate. Before the server starts.
  grpc::Service* Guard(grpc::Service* inner, const google::protobuf::ServiceDescriptor* descriptor);
  // The same for a generated service class (pb::NodeService etc.).
  template <typename GeneratedService>
  grpc::Service* Guard(typename GeneratedService::Service* inner) {
    return Guard(inner, google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(GeneratedService::service_full_name()));
  }
  // The interceptor to install on the server that serves the guarded services.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Interceptor();

  // Interceptor side.
  // The rule for `method`, or null when the gate does not check it (a service it does not guard).
  // A method of a guarded service without a rule gets a rule that refuses it.
  const AuthRule* RuleFor(const std::string& method) const;
  void Decide(const grpc::ServerContextBase* ctx, absl::Status verdict);
  void Forget(const grpc::ServerContextBase* ctx);
  void CountRefused(const std::string& method, const std::string& what) const {
    if (on_refused_ && !what.empty()) on_refused_(method, what);
  }
  // Handler side: the verdict for `ctx`, removed. INTERNAL when the interceptor never decided
  // (the gate fails closed: a guarded service served without its interceptor answers nothing).
  absl::Status Take(const grpc::ServerContextBase* ctx);

 private:
  RefusalCounter on_refused_;
  absl::flat_hash_map<std::string, AuthRule> rules_;
  std::vector<std::string> guarded_prefixes_;  // "/pkg.Service/"
  AuthRule refuse_unlisted_;
  std::deque<std::string> method_names_;  // stable storage for the guarded services' method names
  std::vector<std::unique_ptr<grpc::Service>> services_;
  absl::Mutex mu_;
  absl::flat_hash_map<const grpc::ServerContextBase*, absl::Status> verdicts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon

#include "daemon/auth_gate.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message_lite.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::internal::MethodHandler;

// A service's handler for method `index` (grpc::Service::GetHandler is protected: reached through
// a pointer to member formed in a derived class, the standard way to call a protected accessor on
// another object of the base type).
struct HandlerAccess : grpc::Service {
  static MethodHandler* Get(grpc::Service* service, int index) { return (service->*&HandlerAccess::GetHandler)(index); }
};

// Runs the guarded service's own handler only for a call the interceptor passed. A refused call is
// handed to the same handler with the refusal as its request status: gRPC's handlers then answer
// that status without calling the service (the path they take for a request that did not parse).
class GateHandler final : public MethodHandler {
 public:
  GateHandler(MethodHandler* inner, AuthGate* gate) : inner_(inner), gate_(gate) {}

  void RunHandler(const HandlerParameter& p) override {
    if (!p.status.ok()) return inner_->RunHandler(p);  // did not parse: gRPC answers, nothing ran
    absl::Status verdict = gate_->Take(p.server_context);
    if (verdict.ok()) return inner_->RunHandler(p);
    inner_->RunHandler(HandlerParameter(p.call, p.server_context, p.request, ToGrpcStatus(verdict), p.internal_data, p.call_requester));
    // The handler destroys the request only when it ran the service: every request here is a
    // protobuf message constructed in the call's arena (its heap-owned fields are freed here).
    if (p.request != nullptr) static_cast<google::protobuf::MessageLite*>(p.request)->~MessageLite();
  }

  void* Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status, void** handler_data) override {
    return inner_->Deserialize(call, req, status, handler_data);
  }

 private:
  MethodHandler* inner_;
  AuthGate* gate_;
};

class GatedService final : public grpc::Service {
 public:
  void Add(const char* name, grpc::internal::RpcMethod::RpcType type, MethodHandler* handler) {
    AddMethod(new grpc::internal::RpcServiceMethod(name, type, handler));
  }
};

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(AuthGate* gate, const AuthRule* rule, grpc::experimental::ServerRpcInfo* info) : gate_(gate), rule_(rule) {
    call_.ctx = info->server_context();
    call_.method = info->method() != nullptr ? info->method() : "?";
  }
  ~AuthInterceptor() override {
    if (decided_) gate_->Forget(call_.ctx);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // Null when the body did not parse: the handler is not called then, nothing to decide.
      if (void* request = m->GetRecvMessage(); request != nullptr) {
        Verdict v = (*rule_)(call_, request);
        if (!v.status.ok()) {
          gate_->CountRefused(call_.method, v.what);
          call_.after = nullptr;
          call_.slot.reset();
        }
        refused_ = !v.status.ok();
        gate_->Decide(call_.ctx, std::move(v.status));
        decided_ = true;
      }
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) response_ = m->GetSendMessage();
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      call_.slot.reset();  // the handler has returned
      if (call_.after && !refused_) {
        const grpc::Status s = m->GetSendStatus();
        call_.after(s, s.ok() ? response_ : nullptr);
      }
      call_.after = nullptr;
    }
    m->Proceed();
  }

 private:
  AuthGate* gate_;
  const AuthRule* rule_;
  AuthCall call_;
  bool decided_ = false, refused_ = false;
  const void* response_ = nullptr;
};

class AuthInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(AuthGate* gate) : gate_(gate) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const AuthRule* rule = gate_->RuleFor(info->method() != nullptr ? info->method() : "");
    return rule == nullptr ? nullptr : new AuthInterceptor(gate_, rule, info);
  }

 private:
  AuthGate* gate_;
};

}  // namespace

AuthGate::AuthGate(RefusalCounter on_refused) : on_refused_(std::move(on_refused)) {
  refuse_unlisted_ = [](AuthCall& call, void*) {
    return Verdict{absl::PermissionDeniedError(absl::StrCat(call.method, ": no access rule for this method (daemon/auth_policy.cc)")),
                   "unlisted"};
  };
}

AuthGate::~AuthGate() = default;

void AuthGate::Add(const std::string& method, AuthRule rule) { rules_[method] = std::move(rule); }

grpc::Service* AuthGate::Guard(grpc::Service* inner, const google::protobuf::ServiceDescriptor* descriptor) {
  auto gated = std::make_unique<GatedService>();
  if (descriptor == nullptr) {  // not linked in: a service without methods (every call UNIMPLEMENTED)
    services_.push_back(std::move(gated));
    return services_.back().get();
  }
  guarded_prefixes_.push_back(absl::StrCat("/", descriptor->full_name(), "/"));
  // The generated service adds its methods in the order of the .proto, as the descriptor lists them.
  for (int i = 0; i < descriptor->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = descriptor->method(i);
    method_names_.push_back(absl::StrCat("/", descriptor->full_name(), "/", m->name()));
    using T = grpc::internal::RpcMethod;
    const T::RpcType type = m->client_streaming() ? (m->server_streaming() ? T::BIDI_STREAMING : T::CLIENT_STREAMING)
                                                  : (m->server_streaming() ? T::SERVER_STREAMING : T::NORMAL_RPC);
    gated->Add(method_names_.back().c_str(), type, new GateHandler(HandlerAccess::Get(inner, i), this));
  }
  services_.push_back(std::move(gated));
  return services_.back().get();
}

const AuthRule* AuthGate::RuleFor(const std::string& method) const {
  if (auto it = rules_.find(method); it != rules_.end()) return &it->second;
  for (const std::string& prefix : guarded_prefixes_) {
    if (absl::StartsWith(method, prefix)) return &refuse_unlisted_;
  }
  return nullptr;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> AuthGate::Interceptor() {
  return std::make_unique<AuthInterceptorFactory>(this);
}

void AuthGate::Decide(const grpc::ServerContextBase* ctx, absl::Status verdict) {
  absl::MutexLock l(&mu_);
  verdicts_[ctx] = std::move(verdict);
}

void AuthGate::Forget(const grpc::ServerContextBase* ctx) {
  absl::MutexLock l(&mu_);
  verdicts_.erase(ctx);
}

absl::Status AuthGate::Take(const grpc::ServerContextBase* ctx) {
  absl::MutexLock l(&mu_);
  auto it = verdicts_.find(ctx);
  if (it == verdicts_.end()) {
    return absl::InternalError("the call reached a guarded service without passing its auth interceptor (server misconfigured)");
  }
  absl::Status s = std::move(it->second);
  verdicts_.erase(it);
  return s;
}

}  // namespace wb::daemon

#include "client/ctl_auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace wb::client {
namespace {

constexpr const char* kValued[] = {"tls_ca", "tls_cert", "tls_key", "tls_server_name", "auth_token_file", "operator_token_file"};

absl::StatusOr<std::string> ReadFlagFile(const std::string& flag, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A token as the daemons read theirs: surrounding whitespace trimmed, printable ASCII, no spaces.
absl::StatusOr<std::string> ReadToken(const std::string& flag, const std::string& path) {
  auto raw = ReadFlagFile(flag, path);
  if (!raw.ok()) return raw.status();
  std::string token(absl::StripAsciiWhitespace(*raw));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is empty"));
  for (unsigned char ch : token) {
    if (ch < 0x21 || ch > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": the token must be printable ASCII without spaces"));
    }
  }
  return token;
}

}  // namespace

CtlFlagSpec WithAuthFlags(CtlFlagSpec spec) {
  for (const char* f : kValued) spec.valued.insert(f);
  return spec;
}

absl::StatusOr<CtlAuth> LoadCtlAuth(const CtlArgs& args) {
  CtlAuth a;
  const int tls_given = args.Has("tls_ca") + args.Has("tls_cert") + args.Has("tls_key");
  if (tls_given != 0 && tls_given != 3) {
    return absl::InvalidArgumentError(
        "--tls_ca, --tls_cert and --tls_key must be given together (the daemons require a client certificate)");
  }
  if (tls_given == 3) {
    for (auto [flag, pem] : {std::pair{"tls_ca", &a.tls_ca_pem}, std::pair{"tls_cert", &a.tls_cert_pem},
                             std::pair{"tls_key", &a.tls_key_pem}}) {
      auto body = ReadFlagFile(flag, args.Get(flag));
      if (!body.ok()) return body.status();
      if (body->find("-----BEGIN") == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", args.Get(flag), ": not a PEM file"));
      }
      *pem = std::move(*body);
    }
  } else if (args.Has("tls_server_name")) {
    return absl::InvalidArgumentError("--tls_server_name needs --tls_ca, --tls_cert and --tls_key");
  }
  a.tls_server_name = args.Get("tls_server_name");
  if (args.Has("auth_token_file")) {
    auto t = ReadToken("auth_token_file", args.Get("auth_token_file"));
    if (!t.ok()) return t.status();
    a.token = std::move(*t);
  }
  if (args.Has("operator_token_file")) {
    auto t = ReadToken("operator_token_file", args.Get("operator_token_file"));
    if (!t.ok()) return t.status();
    a.operator_token = std::move(*t);
  }
  return a;
}

std::shared_ptr<grpc::Channel> MakeCtlChannel(const std::string& target, bool unix_socket, const CtlAuth& auth) {
  if (unix_socket || !auth.tls()) return grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = auth.tls_ca_pem;
  o.pem_private_key = auth.tls_key_pem;
  o.pem_cert_chain = auth.tls_cert_pem;
  grpc::ChannelArguments args;
  if (!auth.tls_server_name.empty()) args.SetSslTargetNameOverride(auth.tls_server_name);
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(o), args);
}

void AddCallCredentials(grpc::ClientContext* ctx, const CtlAuth& auth, bool operator_call) {
  if (!auth.token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", auth.token));
  if (operator_call && !auth.operator_token.empty()) ctx->AddMetadata(kOperatorTokenHeader, auth.operator_token);
}

std::string CredentialHint(const absl::Status& s, const CtlAuth& auth, bool operator_call) {
  if (absl::IsUnauthenticated(s)) {
    if (auth.token.empty() && !auth.tls()) {
      return " (the daemons run with a cluster token and / or mutual TLS: pass --auth_token_file and / or "
             "--tls_ca --tls_cert --tls_key as they use)";
    }
    return " (check --auth_token_file and --tls_* against the daemons' own files)";
  }
  if (absl::IsPermissionDenied(s) && operator_call && auth.operator_token.empty()) {
    return " (the daemons require the operator credential: pass --operator_token_file, or a certificate named "
           "in their --operator_names)";
  }
  if (absl::IsUnavailable(s) && !auth.tls()) {
    return " (a daemon with --tls_* also needs --tls_ca --tls_cert --tls_key here)";
  }
  return "";
}

}  // namespace wb::client

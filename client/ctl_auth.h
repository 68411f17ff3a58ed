#pragma once
// wbctl's credentials for a cluster that runs with mutual TLS and / or the shared token
// (docs/security.md): the same files the daemons take, plus the operator credential that
// CoordinatorService.Drain / NodeService.Drain ask for when the daemons run with
// --operator_token_file or --operator_names.
//
//   --tls_ca FILE --tls_cert FILE --tls_key FILE   mutual TLS (all three or none): the CA that
//                                                  signs the daemons, and wbctl's own certificate
//   --tls_server_name NAME                         name expected in the daemon's certificate
//                                                  (default: the host of --addr)
//   --auth_token_file FILE                         the cluster token ("authorization: Bearer")
//   --operator_token_file FILE                     the operator token, sent on Drain only
//                                                  ("x-wb-operator-token")
// None of them applies to a worker socket (unix:PATH), which is plain and local.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/ctl_args.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace wb::client {

// Appended to the usage of every subcommand that dials a daemon.
inline constexpr char kCtlAuthUsage[] =
    "  secured cluster: [--tls_ca F --tls_cert F --tls_key F] [--tls_server_name N] [--auth_token_file F]\n"
    "                   [--operator_token_file F] (Drain only; the daemons' --operator_token_file)\n";

// The header that carries the operator token (the daemons read the same name).
inline constexpr char kOperatorTokenHeader[] = "x-wb-operator-token";

struct CtlAuth {
  std::string tls_ca_pem, tls_cert_pem, tls_key_pem;  // all three or none
  std::string tls_server_name;
  std::string token;           // empty: none sent
  std::string operator_token;  // empty: none sent
  bool tls() const { return !tls_cert_pem.empty(); }
};

// Adds the credential flags above to a subcommand's flag spec.
CtlFlagSpec WithAuthFlags(CtlFlagSpec spec);
// Reads the files the flags name. INVALID_ARGUMENT names the flag (unreadable file, TLS flags not
// all given, an empty token or one with spaces / control characters, a file that is not PEM).
absl::StatusOr<CtlAuth> LoadCtlAuth(const CtlArgs& args);

// A channel to `target` ("host:port" or "unix:PATH"): TLS when configured (never over unix:).
std::shared_ptr<grpc::Channel> MakeCtlChannel(const std::string& target, bool unix_socket, const CtlAuth& auth);
// Adds the cluster token (and, for an operator call, the operator token) to a call's metadata.
void AddCallCredentials(grpc::ClientContext* ctx, const CtlAuth& auth, bool operator_call);
// A hint appended to an error from a daemon: which wbctl flag is probably missing, or "".
std::string CredentialHint(const absl::Status& s, const CtlAuth& auth, bool operator_call);

}  // namespace wb::client

// weightbridged: flags and wiring only. Logic lives in daemon/server.h and what it starts.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "daemon/device_staging.h"
#include "daemon/digest/checksum_fold.h"
#include "daemon/fd_limit.h"
#include "daemon/log.h"
#include "daemon/node/live_markers.h"
#include "daemon/server.h"
#include "transport/cpu_affinity.h"
#include "transport/device_allocator.h"
#include "transport/factory.h"
#include "transport/host_tcp/nic_list.h"

ABSL_FLAG(std::string, role, "standalone", "node | coordinator | standalone");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address (port 0 = pick one)");
ABSL_FLAG(std::string, port_file, "", "write the chosen port here once listening");
ABSL_FLAG(std::string, worker_socket, "", "Unix socket path for WorkerService (node/standalone)");
ABSL_FLAG(std::string, coordinator, "", "coordinator host:port (role=node)");
ABSL_FLAG(std::string, node_id, "node0", "this node's id");
ABSL_FLAG(std::string, data_listen, "127.0.0.1:0",
          "TCP data-plane bind address (host:port; the host_tcp transport picks its own port)");
ABSL_FLAG(std::string, data_advertise, "", "address peers dial for the TCP data plane (default: the --data_listen host)");
ABSL_FLAG(std::string, data_nics, "",
          "host_tcp multi-NIC striping: comma-separated IPv4 addresses or interface names of this node's data NICs "
          "(e.g. 10.0.0.5,10.0.1.5 or eth2,eth3); one listener per NIC, streams spread over (local, remote) NIC pairs. "
          "Empty = one address (--data_listen / --data_advertise). Needs --tcp_streams >= the NIC count");
ABSL_FLAG(std::string, data_cpus, "",
          "CPU list (e.g. 0-15,32-47) the data-plane threads (host_tcp streams, host_shm copies) are pinned to; "
          "empty = they float");
ABSL_FLAG(int, data_numa_node, -1,
          "pin the data-plane threads to the CPUs of this NUMA node (/sys/devices/system/node/nodeN/cpulist); "
          "-1 = off; exclusive with --data_cpus");
ABSL_FLAG(std::string, transports, "", "comma-separated transport kinds (default: every usable one: cuda_ipc,nccl,host_shm,host_tcp)");
ABSL_FLAG(int, tcp_streams, 4, "parallel TCP connections per peer node");
ABSL_FLAG(int64_t, tcp_chunk_bytes, int64_t{1} << 20,
          "host_tcp frame payload size (bytes, >= 4096); ops whose digests host_tcp hashes use frames of whole "
          "2^20-element units, at least one unit");
ABSL_FLAG(double, max_send_gbps, 0,
          "cap on what this node sends over host_tcp, in Gb/s over all peers and NICs (leave the trainer's collectives "
          "their share of a shared NIC); 0 = no cap (docs/transport.md \"host_tcp: egress cap\")");
ABSL_FLAG(int, copy_threads, 4, "same-node copy threads (host_shm)");
ABSL_FLAG(bool, checksums, false,
          "also verify an xxh3 checksum of every cross-node batch on the wire; default: on only with --digests=false "
          "(end-to-end digests check every op's landed bytes against what its source read, which covers the wire)");
ABSL_FLAG(bool, digests, true,
          "end-to-end digests: every version commits only when what each op landed matches what its source read "
          "(docs/daemon.md \"End-to-end digests\")");
ABSL_FLAG(bool, digest_overlap, true,
          "hash the digests while the buckets run (sources at once, each landed box as its batch completes); false: all "
          "after the buckets (bench:e2e --digest_cost measures both)");
ABSL_FLAG(bool, digest_in_transport, true,
          "with --digest_overlap: host_tcp hashes what it sends and receives as the bytes cross (each 2^20-element chunk of "
          "an op), instead of the node hashing those boxes from memory (docs/daemon.md \"End-to-end digests\")");
ABSL_FLAG(uint64_t, delta_cache_bytes, 0,
          "lossless deltas: host memory per model for copies of what this node's destinations committed; > 0 = send "
          "versions as deltas against them across nodes (about the bytes this node sends per version; 0 = off). "
          "docs/daemon.md \"Deltas (design and status)\"");
ABSL_FLAG(int, delta_threads, 0,
          "lossless deltas: encode / decode threads per version (the codec's CPU time is a delta version's time); "
          "0 = half this machine's CPUs, at least 2, at most 16");
ABSL_FLAG(int, quantize_early_threads, 0,
          "quantised rollouts: threads that quantise a piece as soon as every op into it landed, while the buckets still "
          "run (0 = half this machine's CPUs, at least 1; -1 = none: everything after the last bucket). "
          "docs/daemon.md \"Quantized targets\"");
ABSL_FLAG(bool, delta_in_place, true,
          "lossless deltas: a rollout's deltas decode in place into the staging its last commit held, once live weights "
          "hold that version (sync: the commit's copy; other modes: Apply) (no copy of the base); false: against "
          "committed staging or the live weights into fresh staging");
ABSL_FLAG(int, delta_apply_delay_ms, 200,
          "lossless deltas: after a commit, the sending node applies the streams it sent to its cached copies this many "
          "ms later, in the background (not while other nodes still copy the version into live weights); 0 = at once");
ABSL_FLAG(double, intra_node_GBps, 370.0, "planner: GPU<->GPU copy bandwidth inside a node, per GPU");
ABSL_FLAG(double, nic_GBps, 50.0, "planner: network bandwidth per GPU per direction");
ABSL_FLAG(bool, colocated, false, "planner: trainer and rollout workers with the same (node, gpu) share memory");
ABSL_FLAG(int64_t, bucket_bytes, int64_t{2} << 30, "planner: max bytes a GPU sends / receives per bucket");
ABSL_FLAG(int64_t, staging_budget_bytes, int64_t{64} << 30, "max staging + snapshot bytes per node");
ABSL_FLAG(std::string, live_state_dir, "",
          "node/standalone: private directory (0700, this user's) where a copy into a worker's live memory is recorded "
          "before its first byte, so that after a crash the restarted daemon reports that worker's weights TORN, and where "
          "its trainers' last answered publishes are kept (a restarted coordinator then counts those numbers used); must "
          "survive a daemon restart. Empty: $STATE_DIRECTORY/live (systemd StateDirectory=) or ${TMPDIR:-/tmp}/weightbridge-<uid>/live");
ABSL_FLAG(std::string, nccl_devices, "all",
          "GPUs that get an nccl lane (their own communicators, so each sends and receives on the NIC nearest to it): "
          "'all' or a comma-separated list of device ordinals; a CUDA buffer on a GPU without a lane goes through a listed "
          "one. Lanes carry GPU staging only, so they are used with --gpu_staging_bytes");
ABSL_FLAG(int64_t, gpu_staging_bytes, 0,
          "GPU-direct staging: bytes per GPU the daemon may cudaMalloc to stage snapshots and incoming versions of CUDA "
          "buffers on the GPU itself (0 = host staging only); past it, host staging");
ABSL_FLAG(int64_t, heartbeat_ms, 500, "node -> coordinator heartbeat period");
ABSL_FLAG(int64_t, lease_ms, 3000, "a node missing heartbeats this long is lost");
ABSL_FLAG(int64_t, transfer_timeout_ms, 60000, "a version not transferred in this time is aborted");
ABSL_FLAG(int64_t, plan_deadline_s, 120, "coordinator: a plan still running after this many seconds is abandoned (DEADLINE_EXCEEDED naming the model; planned again when its layouts are submitted again); 0: no deadline");
ABSL_FLAG(int64_t, sync_pause_timeout_ms, 30000,
          "coordinator / standalone, sync models: once one rollout of a fully-published version's plan paused (BeginUpdate), "
          "the version waits at most this long for the others to pause; then they are left out of the plan (logged, "
          "wb_versions_total{event=\"rollout_left_out\"}, shown in wbctl status) until their next BeginUpdate, which puts "
          "them back and catches them up. Keep it below the trainers' publish timeout (clients: 60 s). 0: wait as long as the "
          "trainers do");
ABSL_FLAG(std::string, log_level, "info", "info | debug | warning | error");
// Observability and security (docs/observability.md, docs/security.md).
ABSL_FLAG(std::string, metrics_listen, "", "Prometheus /metrics host:port (port 0 = pick one); empty = off");
ABSL_FLAG(std::string, metrics_port_file, "", "write the chosen metrics port here once listening");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate of this daemon (mutual TLS between daemons)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA that signs every daemon's certificate");
ABSL_FLAG(std::string, tls_server_name, "", "expected name in peer certificates (default: the host dialed)");
ABSL_FLAG(bool, tls_bind_node_id, true,
          "with --tls_*: a node may act only as the node id its certificate names (CN or SAN), and accepts the coordinator's "
          "NodeService calls only from a certificate naming the coordinator (--tls_server_name, else the host of --coordinator); "
          "issue one certificate per node");
ABSL_FLAG(std::string, operator_token_file, "",
          "file holding the operator token (not the cluster token): with it (or --operator_names), draining the whole "
          "cluster or another node, and lifting such a drain, need it (wbctl --operator_token_file); a node forwarding "
          "an accepted Drain sends its own copy. Give every daemon the same file (docs/security.md \"Operators\")");
ABSL_FLAG(std::string, operator_names, "",
          "with --tls_*: comma-separated certificate names (CN or SAN) whose holders are operators (may drain the "
          "cluster or any node; docs/security.md \"Operators\")");
ABSL_FLAG(std::string, auth_token_file, "", "file holding the shared token checked on every daemon RPC and proven on every data-channel (host_tcp) connection");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{256} << 20, "largest gRPC message accepted");
ABSL_FLAG(int32_t, max_pieces_per_layout, 1 << 20, "pieces one layout may have");
ABSL_FLAG(int32_t, max_tensors_per_model, 1 << 17, "tensors one model may have");
ABSL_FLAG(int32_t, max_buffers_per_worker, 1024, "buffers one worker may register");
ABSL_FLAG(int32_t, max_vmm_fds_per_worker, 8192, "CUDA VMM allocation fds one worker may hand over (torch expandable segments: one per 20 MiB page)");
ABSL_FLAG(int32_t, max_vmm_fds_per_uid, 65536, "CUDA VMM allocation fds all workers of one uid may hand over");
ABSL_FLAG(int32_t, max_vmm_fds_per_node, 131072, "CUDA VMM allocation fds the node keeps in total (also at most half the fd limit)");
ABSL_FLAG(int32_t, max_concurrent_versions, 16, "versions a trainer may have published and not yet committed");
ABSL_FLAG(int32_t, max_unauthenticated_per_source, 64,
          "gRPC port: connections one source address may hold before their first authenticated call");
ABSL_FLAG(int32_t, max_blocked_calls, 512,
          "calls that block (WaitVersion, Publish, Apply, BeginUpdate, Drain) one server holds at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, max_blocked_calls_per_worker, 4, "of those, what one worker may hold at once on the worker socket");
ABSL_FLAG(int32_t, max_blocked_calls_per_node, 0, "of those, what one node may hold at once at the coordinator; 0 = max(16, max_blocked_calls / 4)");
ABSL_FLAG(int64_t, max_wait_ms, 3600000, "longest wait a call may ask for (timeout_ms of WaitVersion, Publish, Apply, Drain, ...); longer ones are cut to it");
ABSL_FLAG(int32_t, max_unauthenticated, 1024, "gRPC port: connections before their first authenticated call, all sources");
ABSL_FLAG(int64_t, unauthenticated_timeout_ms, 10000, "gRPC port: a connection with no authenticated call by then is closed");

namespace {

int Fail(const std::string& msg) {
  std::fprintf(stderr, "weightbridged: %s\n", msg.c_str());
  return 2;
}

// Many descriptors per worker (shm segments, VMM allocation fds, data sockets): lift the soft limit.
void RaiseFdLimitOrWarn() {
  if (auto fds = wb::daemon::RaiseFdLimit(); !fds.ok()) {
    wb::daemon::Log(wb::daemon::LogLevel::kWarning, "cannot raise the open-file limit", {{"error", fds.status().message()}});
  } else if (fds->now < 65536) {
    wb::daemon::Log(wb::daemon::LogLevel::kWarning, "open-file limit is low: large VMM workers may hit it",
                    {{"limit", static_cast<uint64_t>(fds->now)}});
  }
}

absl::Status CheckNumericFlags() {
  if (absl::GetFlag(FLAGS_tcp_streams) < 1 || absl::GetFlag(FLAGS_copy_threads) < 1) {
    return absl::InvalidArgumentError("--tcp_streams and --copy_threads must be >= 1");
  }
  if (absl::GetFlag(FLAGS_tcp_chunk_bytes) < 4096 || absl::GetFlag(FLAGS_tcp_chunk_bytes) > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("--tcp_chunk_bytes must be in [4096, 2^30], not ", absl::GetFlag(FLAGS_tcp_chunk_bytes)));
  }
  if (const int t = absl::GetFlag(FLAGS_delta_apply_delay_ms); t < 0 || t > 60000) {
    return absl::InvalidArgumentError(absl::StrCat("--delta_apply_delay_ms must be in [0, 60000], not ", t));
  }
  if (const int t = absl::GetFlag(FLAGS_delta_threads); t < 0 || t > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--delta_threads must be in [0, 256] (0 = half the CPUs), not ", t));
  }
  if (const int t = absl::GetFlag(FLAGS_quantize_early_threads); t < -1 || t > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--quantize_early_threads must be in [-1, 256] (0 = half the CPUs, -1 = none), not ", t));
  }
  if (const double cap = absl::GetFlag(FLAGS_max_send_gbps); !(cap >= 0) || std::isinf(cap)) {
    return absl::InvalidArgumentError(absl::StrCat("--max_send_gbps must be a finite number >= 0 (0 = no cap), not ", cap));
  }
  if (!(absl::GetFlag(FLAGS_intra_node_GBps) > 0) || !(absl::GetFlag(FLAGS_nic_GBps) > 0) || absl::GetFlag(FLAGS_bucket_bytes) <= 0) {
    return absl::InvalidArgumentError("--intra_node_GBps, --nic_GBps and --bucket_bytes must be > 0");
  }
  for (auto [name, v] : {std::pair{"heartbeat_ms", absl::GetFlag(FLAGS_heartbeat_ms)},
                         std::pair{"lease_ms", absl::GetFlag(FLAGS_lease_ms)},
                         std::pair{"transfer_timeout_ms", absl::GetFlag(FLAGS_transfer_timeout_ms)},
                         std::pair{"staging_budget_bytes", absl::GetFlag(FLAGS_staging_budget_bytes)}}) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be > 0"));
  }
  if (absl::GetFlag(FLAGS_gpu_staging_bytes) < 0) return absl::InvalidArgumentError("--gpu_staging_bytes must be >= 0");
  if (absl::GetFlag(FLAGS_plan_deadline_s) < 0) return absl::InvalidArgumentError("--plan_deadline_s must be >= 0 (0: no deadline)");
  if (absl::GetFlag(FLAGS_sync_pause_timeout_ms) < 0) {
    return absl::InvalidArgumentError("--sync_pause_timeout_ms must be >= 0 (0: wait as long as the trainers do)");
  }
  return absl::OkStatus();
}

// --nccl_devices: empty = every visible GPU.
absl::StatusOr<std::vector<int>> NcclDevicesFlag() {
  std::vector<int> nccl_devices;
  if (const std::string list = absl::GetFlag(FLAGS_nccl_devices); list != "all") {
    for (absl::string_view d : absl::StrSplit(list, ',')) {
      int device = -1;
      if (!absl::SimpleAtoi(d, &device) || device < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--nccl_devices: '", d, "' is not a device ordinal (want 'all' or e.g. 0,1,2,3)"));
      }
      nccl_devices.push_back(device);
    }
  }
  return nccl_devices;
}

absl::StatusOr<std::vector<std::string>> DataNicsFlag() {
  auto data_nics = wb::transport::ParseNicList(absl::GetFlag(FLAGS_data_nics));
  if (!data_nics.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_nics: ", data_nics.status().message()));
  for (const std::string& nic : *data_nics) {
    if (auto a = wb::transport::ResolveNic(nic); !a.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_nics: ", a.status().message()));
  }
  if (!data_nics->empty() && !absl::GetFlag(FLAGS_data_advertise).empty()) {
    return absl::InvalidArgumentError("--data_advertise applies to the single-address data plane; with --data_nics every NIC is advertised as is");
  }
  if (static_cast<int>(data_nics->size()) > absl::GetFlag(FLAGS_tcp_streams)) {
    return absl::InvalidArgumentError(absl::StrCat("--tcp_streams (", absl::GetFlag(FLAGS_tcp_streams), ") must be >= the ", data_nics->size(),
                                                   " --data_nics, or some NIC carries no stream"));
  }
  return *std::move(data_nics);
}

// --data_cpus / --data_numa_node: empty = the data-plane threads float.
absl::StatusOr<std::vector<int>> DataCpusFlag() {
  std::vector<int> data_cpus;
  if (const std::string list = absl::GetFlag(FLAGS_data_cpus); !list.empty()) {
    if (absl::GetFlag(FLAGS_data_numa_node) >= 0) return absl::InvalidArgumentError("--data_cpus and --data_numa_node are exclusive");
    auto cpus = wb::transport::ParseCpuList(list);
    if (!cpus.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_cpus: ", cpus.status().message()));
    data_cpus = *cpus;
  } else if (const int node = absl::GetFlag(FLAGS_data_numa_node); node >= 0) {
    auto cpus = wb::transport::NumaNodeCpus(node);
    if (!cpus.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_numa_node: ", cpus.status().message()));
    data_cpus = *cpus;
  } else if (node < -1) {
    return absl::InvalidArgumentError("--data_numa_node must be a NUMA node number or -1 (off)");
  }
  if (!data_cpus.empty()) {
    if (absl::Status s = wb::transport::ValidateCpuSet(data_cpus); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--data_cpus: ", s.message()));
    }
  }
  return data_cpus;
}

// Credentials, request limits and connection limits (docs/security.md).
absl::Status SecurityFromFlags(wb::daemon::ServerOptions& o) {
  auto auth = wb::daemon::LoadPeerAuth(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca),
                                       absl::GetFlag(FLAGS_auth_token_file));
  if (!auth.ok()) return auth.status();
  auth->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  auth->bind_node_id = absl::GetFlag(FLAGS_tls_bind_node_id);
  // A node accepts the coordinator-only NodeService calls from the certificate it verifies when it
  // dials the coordinator (docs/security.md "A node acts only as itself").
  if (absl::GetFlag(FLAGS_role) == "node" && auth->tls() && auth->bind_node_id) {
    auth->coordinator_identity =
        auth->tls_server_name.empty() ? wb::daemon::TargetHost(absl::GetFlag(FLAGS_coordinator)) : auth->tls_server_name;
  }
  RETURN_IF_ERROR(wb::daemon::LoadOperatorCredential(absl::GetFlag(FLAGS_operator_token_file), absl::GetFlag(FLAGS_operator_names), &*auth));
  if ((auth->tls() || !auth->token.empty()) && !auth->operator_required() && absl::GetFlag(FLAGS_role) != "standalone") {
    wb::daemon::Log(wb::daemon::LogLevel::kWarning,
                    "Drain is open to every cluster identity: any token / certificate holder can drain the whole cluster or another "
                    "node; set --operator_token_file (or --operator_names) on every daemon",
                    {});
  }
  o.security.peer_auth = std::make_shared<wb::daemon::PeerAuthConfig>(std::move(*auth));
  o.security.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  wb::daemon::Limits& l = o.security.limits;
  l.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  l.max_pieces_per_layout = absl::GetFlag(FLAGS_max_pieces_per_layout);
  l.max_tensors_per_model = absl::GetFlag(FLAGS_max_tensors_per_model);
  l.max_buffers_per_worker = absl::GetFlag(FLAGS_max_buffers_per_worker);
  l.max_vmm_fds_per_worker = absl::GetFlag(FLAGS_max_vmm_fds_per_worker);
  l.max_vmm_fds_per_uid = absl::GetFlag(FLAGS_max_vmm_fds_per_uid);
  l.max_blocked_calls = absl::GetFlag(FLAGS_max_blocked_calls);
  l.max_blocked_calls_per_worker = absl::GetFlag(FLAGS_max_blocked_calls_per_worker);
  l.max_blocked_calls_per_node = absl::GetFlag(FLAGS_max_blocked_calls_per_node);
  l.max_wait_ms = absl::GetFlag(FLAGS_max_wait_ms);
  l.max_vmm_fds_per_node = absl::GetFlag(FLAGS_max_vmm_fds_per_node);
  l.max_concurrent_versions = absl::GetFlag(FLAGS_max_concurrent_versions);
  l.max_worker_bytes = o.staging_budget_bytes;  // a worker's buffers are mirrored in staging
  l.cuda_staged_on_gpu = absl::GetFlag(FLAGS_gpu_staging_bytes) > 0;
  wb::daemon::ConnLimits& cl = o.security.connections;
  cl.max_unauthenticated_per_source = absl::GetFlag(FLAGS_max_unauthenticated_per_source);
  cl.max_unauthenticated = absl::GetFlag(FLAGS_max_unauthenticated);
  cl.unauthenticated_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_unauthenticated_timeout_ms));
  if (cl.max_unauthenticated_per_source <= 0 || cl.max_unauthenticated <= 0 || cl.unauthenticated_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_unauthenticated_per_source, --max_unauthenticated and --unauthenticated_timeout_ms must be > 0");
  }
  if (l.max_message_bytes <= 0 || l.max_pieces_per_layout <= 0 || l.max_tensors_per_model <= 0 || l.max_buffers_per_worker <= 0 ||
      l.max_vmm_fds_per_worker <= 0 || l.max_vmm_fds_per_uid <= 0 || l.max_blocked_calls <= 0 || l.max_vmm_fds_per_node <= 0 ||
      l.max_concurrent_versions <= 0 || l.max_blocked_calls_per_worker <= 0 || l.max_wait_ms <= 0) {
    return absl::InvalidArgumentError("--max_* limits must be > 0");
  }
  if (l.max_blocked_calls_per_node < 0) {
    return absl::InvalidArgumentError("--max_blocked_calls_per_node must be >= 0 (0 = max(16, --max_blocked_calls / 4))");
  }
  return absl::OkStatus();
}

// Every flag into the server's options; the concrete transports are picked here and only here
// (the planner is planner::MakePlan).
absl::StatusOr<wb::daemon::ServerOptions> ServerOptionsFromFlags(int argc, char** argv) {
  auto role = wb::daemon::ParseRole(absl::GetFlag(FLAGS_role));
  if (!role.ok()) return role.status();
  RETURN_IF_ERROR(CheckNumericFlags());
  ASSIGN_OR_RETURN(std::vector<int> nccl_devices, NcclDevicesFlag());
  ASSIGN_OR_RETURN(std::vector<std::string> data_nics, DataNicsFlag());
  ASSIGN_OR_RETURN(std::vector<int> data_cpus, DataCpusFlag());

  wb::daemon::ServerOptions o;
  o.role = *role;
  // The process's one metrics instance, given to every role; never destroyed (gRPC threads may
  // still record while the process exits). Held by a static so that it stays reachable after the
  // server is gone (else LeakSanitizer reports it at exit and a clean shutdown exits 1 under ASan).
  static wb::daemon::DaemonMetrics* const process_metrics = new wb::daemon::DaemonMetrics();
  o.metrics = process_metrics;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.worker_socket = absl::GetFlag(FLAGS_worker_socket);
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.node_id = absl::GetFlag(FLAGS_node_id);
  o.data_listen = absl::GetFlag(FLAGS_data_listen);
  o.staging_budget_bytes = absl::GetFlag(FLAGS_staging_budget_bytes);
  o.live_state_dir = absl::GetFlag(FLAGS_live_state_dir);
  if (o.live_state_dir.empty()) o.live_state_dir = wb::daemon::LiveMarkers::DefaultDir();
  o.heartbeat = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_ms));
  o.lease = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  o.transfer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_transfer_timeout_ms));
  o.plan_deadline = absl::Seconds(absl::GetFlag(FLAGS_plan_deadline_s));
  o.sync_pause_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_sync_pause_timeout_ms));
  RETURN_IF_ERROR(SecurityFromFlags(o));
  o.topology.intra_node_GBps = absl::GetFlag(FLAGS_intra_node_GBps);
  o.topology.nic_GBps_per_gpu = absl::GetFlag(FLAGS_nic_GBps);
  o.topology.colocated = absl::GetFlag(FLAGS_colocated);
  o.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  o.digests = absl::GetFlag(FLAGS_digests);
  o.digest_overlap = absl::GetFlag(FLAGS_digest_overlap);
  o.digest_in_transport = absl::GetFlag(FLAGS_digest_in_transport);
  o.delta_cache_bytes = absl::GetFlag(FLAGS_delta_cache_bytes);
  o.delta_threads = absl::GetFlag(FLAGS_delta_threads);
  o.delta_in_place = absl::GetFlag(FLAGS_delta_in_place);
  o.quantize_early_threads = absl::GetFlag(FLAGS_quantize_early_threads);
  o.delta_apply_delay = absl::Milliseconds(absl::GetFlag(FLAGS_delta_apply_delay_ms));
  // Per-batch checksums only repeat what the digests check: off with digests, unless asked for.
  o.checksums = wb::digest::ChecksumsOn(argc, argv, o.digests, absl::GetFlag(FLAGS_checksums));
  wb::transport::TransportConfig tc;
  for (absl::string_view k : absl::StrSplit(absl::GetFlag(FLAGS_transports), ',', absl::SkipEmpty())) tc.kinds.emplace_back(k);
  const std::string data_listen = absl::GetFlag(FLAGS_data_listen);
  tc.tcp.bind_address = data_listen.substr(0, data_listen.rfind(':'));
  if (tc.tcp.bind_address.empty()) tc.tcp.bind_address = "127.0.0.1";
  tc.tcp.advertise_address = absl::GetFlag(FLAGS_data_advertise);
  tc.tcp.streams = absl::GetFlag(FLAGS_tcp_streams);
  tc.tcp.max_send_bytes_per_s = absl::GetFlag(FLAGS_max_send_gbps) * 1e9 / 8;
  tc.tcp.chunk_bytes = absl::GetFlag(FLAGS_tcp_chunk_bytes);
  tc.tcp.local_addresses = std::move(data_nics);
  tc.cpus = std::move(data_cpus);
  // The data channel proves the same shared token as the daemon RPCs (docs/security.md).
  tc.tcp.auth_token = o.security.peer_auth->token;
  tc.host_shm.threads = absl::GetFlag(FLAGS_copy_threads);
  tc.nccl.devices = std::move(nccl_devices);
  o.make_transports = [tc] { return wb::transport::CreateTransports(tc); };
  if (absl::GetFlag(FLAGS_gpu_staging_bytes) > 0) {
    o.device_staging = std::make_shared<wb::daemon::DeviceStaging>(wb::transport::NewDeviceAllocator(),
                                                                   absl::GetFlag(FLAGS_gpu_staging_bytes));
  }
  return o;
}

// Write then rename, so a reader never sees a partial file.
absl::Status WritePortFile(const std::string& path, int port, absl::string_view flag) {
  if (path.empty()) return absl::OkStatus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << port << "\n";
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write --", flag, " ", path));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::UnavailableError(absl::StrCat("cannot write --", flag, " ", path));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("WeightBridge daemon: weightbridged --role=node|coordinator|standalone --worker_socket=PATH ...");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) return Fail(absl::StrCat("unexpected argument '", rest[1], "'"));
  auto level = wb::daemon::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) return Fail(std::string(level.status().message()));
  wb::daemon::SetLogLevel(*level);
  RaiseFdLimitOrWarn();
  auto options = ServerOptionsFromFlags(argc, argv);
  if (!options.ok()) return Fail(std::string(options.status().message()));

  // SIGTERM/SIGINT are taken synchronously below; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = wb::daemon::Server::Start(*std::move(options));
  if (!server.ok()) return Fail(std::string(server.status().message()));
  std::printf("weightbridged role=%s node_id=%s listening on %s port %d\n", absl::GetFlag(FLAGS_role).c_str(),
              absl::GetFlag(FLAGS_node_id).c_str(), (*server)->address().c_str(), (*server)->port());
  std::fflush(stdout);
  if ((*server)->metrics_port() > 0) {
    std::printf("weightbridged metrics on port %d\n", (*server)->metrics_port());
    std::fflush(stdout);
    if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_metrics_port_file), (*server)->metrics_port(), "metrics_port_file"); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  }
  if (absl::Status s = WritePortFile(absl::GetFlag(FLAGS_port_file), (*server)->port(), "port_file"); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("weightbridged: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  (*server)->Shutdown();
  return 0;
}

// wbctl's pure parts: flag parsing, address parsing, status rendering and watch arithmetic.
#include <cstdio>
#include <mutex>
#include <sstream>
#include <vector>

#include "absl/time/time.h"
#include "client/ctl_args.h"
#include "client/ctl_auth.h"
#include "client/ctl_client.h"
#include "client/status_command.h"
#include "client/status_view.h"
#include "client/watch_command.h"
#include "client/drain_command.h"
#include "grpcpp/grpcpp.h"
#include "proto/weightbridge.grpc.pb.h"
#include "gtest/gtest.h"

namespace wb::client {
namespace {

namespace pb = ::weightbridge::v1;

TEST(CtlArgsTest, ParsesValuedAndBooleanFlags) {
  auto a = CtlArgs::Parse({"--addr", "127.0.0.1:5", "--json", "--timeout=2s", "--version=7"},
                          {{"addr", "timeout", "version"}, {"json"}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Get("addr"), "127.0.0.1:5");
  EXPECT_TRUE(a->Has("json"));
  EXPECT_EQ(*a->GetDuration("timeout", absl::Seconds(1)), absl::Seconds(2));
  EXPECT_EQ(*a->GetUint("version", 0), 7u);
  EXPECT_EQ(*a->GetDuration("missing", absl::Seconds(9)), absl::Seconds(9));
  EXPECT_FALSE(CtlArgs::Parse({"--bogus"}, {{"addr"}, {}}).ok());
  EXPECT_FALSE(CtlArgs::Parse({"stray"}, {{"addr"}, {}}).ok());
  EXPECT_FALSE(CtlArgs::Parse({"--addr"}, {{"addr"}, {}}).ok());
  auto bad = CtlArgs::Parse({"--timeout=soon"}, {{"timeout"}, {}});
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(bad->GetDuration("timeout", absl::Seconds(1)).ok());
  auto secs = CtlArgs::Parse({"--timeout=1.5"}, {{"timeout"}, {}});
  EXPECT_EQ(*secs->GetDuration("timeout", absl::Seconds(1)), absl::Milliseconds(1500));
}

TEST(CtlAddressTest, AcceptsHostPortAndUnix) {
  EXPECT_FALSE(ParseCtlAddress("127.0.0.1:4000")->unix_socket);
  EXPECT_TRUE(ParseCtlAddress("unix:/tmp/x.sock")->unix_socket);
  EXPECT_EQ(ParseCtlAddress("/tmp/x.sock")->target, "unix:/tmp/x.sock");
  EXPECT_FALSE(ParseCtlAddress("localhost").ok());
  EXPECT_FALSE(ParseCtlAddress("host:0").ok());
  EXPECT_FALSE(ParseCtlAddress("").ok());
  // Hosts gRPC's resolver would only refuse after the connect timeout.
  EXPECT_FALSE(ParseCtlAddress("[::1").ok());
  EXPECT_FALSE(ParseCtlAddress("::1:4000").ok());
  EXPECT_FALSE(ParseCtlAddress("a b:4000").ok());
  EXPECT_FALSE(ParseCtlAddress("[]:4000").ok());
  EXPECT_TRUE(ParseCtlAddress("[::1]:4000").ok());
  EXPECT_TRUE(ParseCtlAddress("[fe80::1%eth0]:4000").ok());
  EXPECT_TRUE(ParseCtlAddress("node-3.cluster.local:4000").ok());
  EXPECT_TRUE(ParseCtlAddress("[fe80::1%br-lan]:4000").ok());
  // gRPC target URIs pass through.
  EXPECT_EQ(ParseCtlAddress("dns:///coord.example.com:7070")->target, "dns:///coord.example.com:7070");
  EXPECT_TRUE(ParseCtlAddress("ipv4:10.0.0.1:7070").ok());
  EXPECT_TRUE(ParseCtlAddress("ipv6:[::1]:7070").ok());
}

pb::StatusResponse Sample() {
  pb::StatusResponse s;
  s.set_role("coordinator");
  auto* n = s.add_nodes();
  n->set_node_id("n1");
  n->set_address("127.0.0.1:1234");
  n->set_alive(true);
  for (const char* t : {"cuda_ipc", "host_shm", "host_tcp", "nccl/0", "nccl/1", "nccl/2", "nccl/3"}) n->add_transports(t);
  auto* m = s.add_models();
  m->set_model_id("qwen");
  m->set_mode(pb::MODE_ASYNC);
  m->set_committed_version(2);
  m->set_last_transfer_seconds(0.5);
  m->set_last_transfer_gbps(1.25);
  for (int v = 3; v >= 1; --v) {
    auto* vs = s.add_versions();
    vs->set_model_id("qwen");
    vs->set_version(v);
    vs->set_state(v == 3 ? "transferring" : v == 2 ? "committed" : "aborted");
    vs->set_bytes_total(1000);
    vs->set_bytes_done(v == 3 ? 250 : 1000);
    vs->set_seconds(v == 3 ? 0.25 : 1.0);
    if (v == 1) vs->set_error("node n2 lost its lease");
  }
  return s;
}

TEST(StatusViewTest, TableAndJsonCarryTheFigures) {
  std::string table = StatusTable(Sample(), "coordinator");
  EXPECT_NE(table.find("qwen"), std::string::npos);
  EXPECT_NE(table.find("1.25"), std::string::npos);
  EXPECT_NE(table.find("lost its lease"), std::string::npos);
  auto j = StatusJson(Sample(), "coordinator");
  EXPECT_EQ(j["models"][0]["last_transfer_GBps"].get<double>(), 1.25);
  EXPECT_EQ(j["models"][0]["mode"].get<std::string>(), "async");
  EXPECT_EQ(j["nodes"][0]["node_id"].get<std::string>(), "n1");
  EXPECT_NE(table.find("cuda_ipc,host_shm,host_tcp,nccl/{0-3}"), std::string::npos) << table;
  EXPECT_EQ(j["nodes"][0]["transports"].size(), 7u);
  EXPECT_EQ(j["nodes"][0]["transports"][3].get<std::string>(), "nccl/0");
  EXPECT_EQ(j["versions"].size(), 3u);
}

// The worker table says what an operator must act on: torn live weights, a copy running, a late
// rollout being caught up, and why a catch-up failed or a source serves the version no more.
TEST(StatusViewTest, WorkerStatesNameTornCatchingUpAndCatchUpErrors) {
  pb::StatusResponse s;
  auto add = [&](const std::string& id) {
    pb::WorkerStatus* w = s.add_workers();
    w->set_worker_id(id);
    w->set_model_id("m");
    w->set_role(pb::ROLE_ROLLOUT);
    w->set_has_layout(true);
    return w;
  };
  add("r-ok");
  add("r-paused")->set_paused(true);
  pb::WorkerStatus* torn = add("r-torn");
  torn->set_live_state("torn");
  torn->set_live_detail("version 3 over version 2: copy failed");
  pb::WorkerStatus* copying = add("r-copy");
  copying->set_live_state("copying");
  copying->set_live_writing_version(4);
  add("r-late")->set_catching_up(true);
  add("r-stale")->set_catch_up_error("its memory no longer holds version 1 (found by a catch-up it was to serve)");
  const std::string table = StatusTable(s, "coordinator");
  for (const char* want : {"r-ok", "paused", "torn: version 3 over version 2: copy failed", "copying v4", "catching up",
                           "catch-up error: its memory no longer holds version 1"}) {
    EXPECT_NE(table.find(want), std::string::npos) << want << "\n" << table;
  }
  auto j = StatusJson(s, "coordinator");
  EXPECT_EQ(j["workers"][2]["live_state"].get<std::string>(), "torn");
  EXPECT_EQ(j["workers"][4]["state"].get<std::string>(), "catching up");
  EXPECT_TRUE(j["workers"][4]["catching_up"].get<bool>());
  EXPECT_NE(j["workers"][5]["catch_up_error"].get<std::string>().find("no longer holds version 1"), std::string::npos);
}

// A sync rollout left out for not pausing (docs/daemon.md "Rollouts that never pause") says so and why.
TEST(StatusViewTest, ALeftOutRolloutIsShownLeftOutWithTheReason) {
  pb::StatusResponse s;
  pb::WorkerStatus* w = s.add_workers();
  w->set_worker_id("r-out");
  w->set_model_id("m");
  w->set_role(pb::ROLE_ROLLOUT);
  w->set_has_layout(true);
  w->set_left_out(true);
  w->set_left_out_reason("did not pause (BeginUpdate) while version 5 waited for it 30s");
  EXPECT_NE(StatusTable(s, "coordinator").find("left out: did not pause (BeginUpdate) while version 5"), std::string::npos)
      << StatusTable(s, "coordinator");
  auto j = StatusJson(s, "coordinator");
  EXPECT_TRUE(j["workers"][0]["left_out"].get<bool>());
  EXPECT_NE(j["workers"][0]["left_out_reason"].get<std::string>().find("version 5"), std::string::npos);
}

TEST(StatusViewTest, TransportsSummaryCollapsesNcclLanes) {
  EXPECT_EQ(TransportsSummary({}), "-");
  EXPECT_EQ(TransportsSummary({"host_shm", "host_tcp"}), "host_shm,host_tcp");
  EXPECT_EQ(TransportsSummary({"host_tcp", "nccl/2"}), "host_tcp,nccl/2");
  EXPECT_EQ(TransportsSummary({"nccl/7", "host_tcp", "nccl/0", "nccl/1", "nccl/2", "nccl/5", "nccl/6"}), "host_tcp,nccl/{0-2,5-7}");
  EXPECT_EQ(TransportsSummary({"nccl/1", "nccl/3"}), "nccl/{1,3}");
  EXPECT_EQ(TransportsSummary({"nccl/x"}), "nccl/x") << "not a lane name: shown as is";
}

TEST(StatusViewTest, MultiNicHostTcpShowsItsNics) {
  EXPECT_EQ(TransportsSummary({"host_shm", "host_tcp"}, {"10.0.0.5", "10.0.1.5"}), "host_shm,host_tcp[10.0.0.5,10.0.1.5]");
  EXPECT_EQ(TransportsSummary({"host_shm", "host_tcp"}, {"10.0.0.5:4100"}), "host_shm,host_tcp[10.0.0.5:4100]")
      << "one listener: its endpoint, where an operator probes the data plane";
  pb::StatusResponse s = Sample();
  s.mutable_nodes(0)->add_data_nics("10.0.0.5");
  s.mutable_nodes(0)->add_data_nics("10.0.1.5");
  EXPECT_NE(StatusTable(s, "coordinator").find("host_tcp[10.0.0.5,10.0.1.5],nccl/{0-3}"), std::string::npos)
      << StatusTable(s, "coordinator");
  auto j = StatusJson(s, "coordinator");
  ASSERT_EQ(j["nodes"][0]["data_nics"].size(), 2u);
  EXPECT_EQ(j["nodes"][0]["data_nics"][1].get<std::string>(), "10.0.1.5");
}

TEST(StatusViewTest, VersionsSortedAndModelLookup) {
  auto vs = VersionsOf(Sample(), "qwen");
  ASSERT_EQ(vs.size(), 3u);
  EXPECT_EQ(vs[0].version(), 1u);
  EXPECT_EQ(vs[2].version(), 3u);
  EXPECT_TRUE(HasModel(Sample(), "qwen"));
  EXPECT_FALSE(HasModel(Sample(), "llama"));
  EXPECT_TRUE(VersionsOf(Sample(), "llama").empty());
}

TEST(StatusViewTest, VersionsShowWhetherEveryOpWasVerified) {
  pb::StatusResponse s = Sample();
  for (auto& v : *s.mutable_versions()) {
    v.set_num_ops(40);
    if (v.version() == 2) {
      v.set_verified(true);
      v.set_ops_verified(40);
    }
    if (v.version() == 1) v.set_ops_verified(12);  // a GPU path: 12 of 40 ops carried digests
  }
  const std::string table = VersionsTable(VersionsOf(s, "qwen"));
  EXPECT_NE(table.find("VERIFIED"), std::string::npos) << table;
  EXPECT_NE(table.find(" yes "), std::string::npos) << table;
  EXPECT_NE(table.find(" 12/40 "), std::string::npos) << table;
  auto j = VersionsJson("qwen", VersionsOf(s, "qwen"));
  EXPECT_FALSE(j["versions"][0]["verified"].get<bool>());
  EXPECT_EQ(j["versions"][0]["ops_verified"].get<uint32_t>(), 12u);
  EXPECT_TRUE(j["versions"][1]["verified"].get<bool>());
}

TEST(StatusViewTest, VersionsShowWhatTravelledAsDeltas) {
  pb::StatusResponse s = Sample();
  for (auto& v : *s.mutable_versions()) {
    if (v.version() == 2) {
      v.set_delta_bytes(42200000);
      v.set_delta_replaced_bytes(988000000);
    }
    if (v.version() == 3) {
      v.set_delta_bytes(40000000);
      v.set_delta_replaced_bytes(900000000);
      v.set_delta_fallback_bytes(88000000);  // refused deltas resent in full
    }
  }
  const std::string table = VersionsTable(VersionsOf(s, "qwen"));
  EXPECT_NE(table.find("DELTA"), std::string::npos) << table;
  EXPECT_NE(table.find(" 42.2 MB/988.0 MB "), std::string::npos) << table;
  EXPECT_NE(table.find(" 40.0 MB/900.0 MB +88.0 MB full "), std::string::npos) << table;
  auto j = VersionsJson("qwen", VersionsOf(s, "qwen"));
  EXPECT_EQ(j["versions"][0]["delta_replaced_bytes"].get<uint64_t>(), 0u);  // version 1: full
  EXPECT_EQ(j["versions"][1]["delta_bytes"].get<uint64_t>(), 42200000u);
  EXPECT_EQ(j["versions"][1]["delta_replaced_bytes"].get<uint64_t>(), 988000000u);
  EXPECT_EQ(j["versions"][2]["delta_fallback_bytes"].get<uint64_t>(), 88000000u);
}

TEST(StatusViewTest, WatchPicksRunningVersionAndComputesRateAndEta) {
  auto picked = PickWatched(Sample(), "", 0);
  ASSERT_TRUE(picked.has_value());
  EXPECT_EQ(picked->version(), 3u);
  EXPECT_EQ(PickWatched(Sample(), "qwen", 1)->state(), "aborted");
  EXPECT_FALSE(PickWatched(Sample(), "llama", 0).has_value());

  WatchProgress p;
  absl::Time t0 = absl::UnixEpoch();
  pb::VersionStatus v = *picked;
  auto first = p.Update(v, t0);
  EXPECT_NEAR(first.rate_GBps, 1000e-9, 1e-12);  // 250 B / 0.25 s average
  v.set_bytes_done(750);
  auto second = p.Update(v, t0 + absl::Seconds(1));
  EXPECT_NEAR(second.rate_GBps, 500e-9, 1e-12);  // 500 B in the last second
  EXPECT_NEAR(second.eta_s, 0.5, 1e-9);
  EXPECT_FALSE(second.final);
  v.set_state("committed");
  EXPECT_TRUE(p.Update(v, t0 + absl::Seconds(2)).final);
  EXPECT_NE(WatchProgress::Format(second).find("ETA 0.5s"), std::string::npos);
}

// Free text in a status comes from other processes: a version's error is what a node of the
// version reported (ReportDoneRequest.error, any bytes a token holder sends), a torn worker's detail
// and a catch-up error from nodes too. wbctl printed them raw, so a node could make an operator's
// terminal run escape sequences (retitle it, clear it, move the cursor) and forge whole lines of
// the table with a newline ("  qwen  9  committed ..."). Control characters are shown escaped in
// every human-readable view; --json carries the text as it is (JSON escapes it).
TEST(StatusViewTest, ControlCharactersInDaemonTextAreShownEscaped) {
  const std::string hostile = std::string("peer vanished\x1b]2;pwned\x07\x1b[2J\r\n  qwen         9        committed") + "\xc2\x9b" + "31m";
  pb::StatusResponse s = Sample();
  s.mutable_versions(0)->set_error(hostile);
  pb::WorkerStatus* w = s.add_workers();
  w->set_worker_id("r9");
  w->set_model_id("qwen");
  w->set_role(pb::ROLE_ROLLOUT);
  w->set_has_layout(true);
  w->set_live_state("torn");
  w->set_live_detail(hostile);
  pb::WorkerStatus* late = s.add_workers();
  *late = *w;
  late->set_worker_id("r10");
  late->clear_live_state();
  late->set_catch_up_error(hostile);
  pb::VersionStatus running = s.versions(0);
  running.set_state("aborted");
  WatchProgress p;
  for (const std::string& out : {StatusTable(s, "coordinator"), VersionsTable(VersionsOf(s, "qwen")),
                                 WatchProgress::Format(p.Update(running, absl::UnixEpoch()))}) {
    for (char c : out) {
      if (c == '\n') continue;
      EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20 || c == 0x7f) << "raw control character " << static_cast<int>(c) << " in:\n" << out;
    }
    EXPECT_EQ(out.find("\xc2\x9b"), std::string::npos) << "raw C1 control (CSI) in:\n" << out;
    EXPECT_EQ(out.find("\n  qwen         9"), std::string::npos) << "a forged line:\n" << out;
    EXPECT_NE(out.find("peer vanished\\x1b]2;pwned\\x07\\x1b[2J\\r\\n  qwen"), std::string::npos) << out;
  }
  // JSON keeps the bytes (nlohmann escapes them in the text it writes).
  EXPECT_EQ(StatusJson(s, "coordinator")["versions"][0]["error"].get<std::string>(), hostile);
}

// A status the coordinator trimmed to its byte budget (StatusResponse.trimmed).
pb::StatusResponse TrimmedSample() {
  pb::StatusResponse s = Sample();
  pb::StatusTrimmed* t = s.mutable_trimmed();
  t->set_budget_bytes(3145728);
  t->set_bytes_before(4613734);
  t->set_nodes_with_lists_cut(2);
  t->set_transports_dropped(96);
  t->set_data_nics_dropped(48);
  t->set_versions_dropped(62);
  (*t->mutable_versions_dropped_by_model())["qwen"] = 62;
  t->set_texts_cut(3);
  return s;
}

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(StatusViewTest, ATrimmedStatusSaysWhatWasLeftOut) {
  const std::string table = StatusTable(TrimmedSample(), "coordinator");
  const std::string line = TrimmedLine(TrimmedSample());
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.rfind("TRIMMED: ", 0), 0u) << line;
  EXPECT_EQ(table.substr(table.size() - line.size()), line) << "the table ends with it:\n" << table;
  for (const char* part : {"byte budget of 3145728 bytes (4613734 before)", "not listed: 96 transports and 48 data NICs of 2 nodes",
                           "62 older finished version records (qwen: 62)", "3 long error texts cut",
                           "Every node, worker, model and running version is listed",
                           "The rest: a model's older versions with --model M", "a node's full transports / NICs with --node N"}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
  }
  EXPECT_EQ(line.find("still over"), std::string::npos);
  auto j = StatusJson(TrimmedSample(), "coordinator");
  ASSERT_TRUE(j["trimmed"].is_object()) << j.dump();
  EXPECT_EQ(j["trimmed"]["budget_bytes"].get<uint64_t>(), 3145728u);
  EXPECT_EQ(j["trimmed"]["bytes_before"].get<uint64_t>(), 4613734u);
  EXPECT_EQ(j["trimmed"]["nodes_with_lists_cut"].get<uint32_t>(), 2u);
  EXPECT_EQ(j["trimmed"]["transports_dropped"].get<uint32_t>(), 96u);
  EXPECT_EQ(j["trimmed"]["data_nics_dropped"].get<uint32_t>(), 48u);
  EXPECT_EQ(j["trimmed"]["versions_dropped"].get<uint32_t>(), 62u);
  EXPECT_EQ(j["trimmed"]["versions_dropped_by_model"]["qwen"].get<uint32_t>(), 62u);
  EXPECT_EQ(j["trimmed"]["texts_cut"].get<uint32_t>(), 3u);
  EXPECT_FALSE(j["trimmed"]["over_budget"].get<bool>());

  // Still over the budget with nothing left to leave out: said, and no "not listed".
  pb::StatusResponse over = Sample();
  over.mutable_trimmed()->set_budget_bytes(1000);
  over.mutable_trimmed()->set_bytes_before(5000);
  over.mutable_trimmed()->set_over_budget(true);
  const std::string over_line = TrimmedLine(over);
  EXPECT_NE(over_line.find("still over the budget"), std::string::npos) << over_line;
  EXPECT_EQ(over_line.find("not listed"), std::string::npos) << over_line;
  EXPECT_TRUE(StatusJson(over, "coordinator")["trimmed"]["over_budget"].get<bool>());

  // wbctl versions --model: how many of the model's records are not listed.
  EXPECT_EQ(VersionsNotListed(TrimmedSample(), "qwen"), 62u);
  EXPECT_EQ(VersionsNotListed(TrimmedSample(), "llama"), 0u);
  EXPECT_EQ(VersionsNotListed(Sample(), "qwen"), 0u);

  // A whole status: no line, "trimmed": null.
  EXPECT_EQ(TrimmedLine(Sample()), "");
  EXPECT_EQ(StatusTable(Sample(), "coordinator").find("TRIMMED"), std::string::npos);
  auto whole = StatusJson(Sample(), "coordinator");
  ASSERT_TRUE(whole.contains("trimmed"));
  EXPECT_TRUE(whole["trimmed"].is_null());
}

TEST(StatusViewTest, WatchSaysOnceInTextAndOnEveryJsonLineThatTheStatusWasTrimmed) {
  const absl::Time t0 = absl::UnixEpoch();
  {
    std::ostringstream out, err;
    WatchFollower f("qwen", 0, /*json=*/false, absl::ZeroDuration(), out, err);
    EXPECT_FALSE(f.Handle(TrimmedSample(), t0).has_value());
    EXPECT_FALSE(f.Handle(TrimmedSample(), t0 + absl::Seconds(1)).has_value());
    EXPECT_EQ(f.followed(), 3u);
    EXPECT_EQ(Count(out.str(), "TRIMMED: "), 1u) << out.str();
    EXPECT_NE(out.str().find("62 older finished version records (qwen: 62)"), std::string::npos) << out.str();
    EXPECT_EQ(Count(out.str(), "qwen v3"), 2u) << out.str();
  }
  {
    std::ostringstream out, err;
    WatchFollower f("qwen", 0, /*json=*/true, absl::ZeroDuration(), out, err);
    f.Handle(TrimmedSample(), t0);
    f.Handle(Sample(), t0 + absl::Seconds(1));
    std::istringstream lines(out.str());
    std::string first, second;
    ASSERT_TRUE(std::getline(lines, first) && std::getline(lines, second)) << out.str();
    auto j1 = nlohmann::json::parse(first);
    auto j2 = nlohmann::json::parse(second);
    EXPECT_EQ(j1["version"].get<uint64_t>(), 3u);
    EXPECT_EQ(j1["status_trimmed"]["versions_dropped"].get<uint32_t>(), 62u) << first;
    EXPECT_EQ(j1["status_trimmed"]["budget_bytes"].get<uint64_t>(), 3145728u) << first;
    EXPECT_FALSE(j2.contains("status_trimmed")) << "a whole status: " << second;
  }
  {
    std::ostringstream out, err;
    WatchFollower f("qwen", 0, /*json=*/false, absl::ZeroDuration(), out, err);
    f.Handle(Sample(), t0);
    EXPECT_EQ(out.str().find("TRIMMED"), std::string::npos) << out.str();
  }
}

TEST(CommandsTest, UsageErrorsExitTwoAndUnreachableDaemonExitsOne) {
  std::ostringstream out, err;
  EXPECT_EQ(RunStatusCommand({"--bogus"}, out, err), kCtlUsage);
  EXPECT_EQ(RunStatusCommand({}, out, err), kCtlUsage);  // no --addr
  EXPECT_EQ(RunVersionsCommand({"--addr", "127.0.0.1:1"}, out, err), kCtlUsage);  // no --model
  EXPECT_EQ(RunDrainCommand({"--addr", "unix:/tmp/x.sock"}, out, err), kCtlUsage);
  EXPECT_EQ(RunDrainCommand({"--addr", "127.0.0.1:1", "--node", "n0", "--all"}, out, err), kCtlUsage);
  EXPECT_EQ(RunWatchCommand({"--addr", "127.0.0.1:1", "--interval", "0"}, out, err), kCtlUsage);
  // Port 1 on loopback: nothing listens there.
  EXPECT_EQ(RunStatusCommand({"--addr", "127.0.0.1:1", "--timeout", "300ms"}, out, err),
            kCtlRpcFailed);
  EXPECT_NE(err.str().find("cannot connect"), std::string::npos);
}

}  // namespace
}  // namespace wb::client

namespace wb::client {
namespace {

// wbctl's credential flags (client/ctl_auth.h): files read as the daemons read theirs; partial or
// unreadable ones are usage errors naming the flag.
TEST(CtlAuthTest, LoadsFlagsAndRefusesPartialOrBadFiles) {
  const std::string dir = ::testing::TempDir();
  auto write = [&](const std::string& name, const std::string& body) {
    const std::string path = dir + "/" + name;
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(body.c_str(), f);
    std::fclose(f);
    return path;
  };
  const std::string token = write("ctl-token", "  tok-1\n");
  const std::string op = write("ctl-op", "op-2\n");
  const std::string spaced = write("ctl-spaced", "a b\n");
  const std::string pem = write("ctl-cert.pem", "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n");
  const std::string not_pem = write("ctl-notpem", "hello\n");
  const CtlFlagSpec spec = WithAuthFlags({{"addr"}, {}});
  auto parse = [&](std::vector<std::string> args) { return LoadCtlAuth(*CtlArgs::Parse(args, spec)); };

  auto ok = parse({"--auth_token_file", token, "--operator_token_file", op});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->token, "tok-1");
  EXPECT_EQ(ok->operator_token, "op-2");
  EXPECT_FALSE(ok->tls());
  auto tls = parse({"--tls_ca", pem, "--tls_cert", pem, "--tls_key", pem, "--tls_server_name", "coord"});
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_TRUE(tls->tls());
  EXPECT_EQ(tls->tls_server_name, "coord");

  for (const auto& bad : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls_ca", pem, "--tls_cert", pem}, "--tls_key"},
           {{"--tls_server_name", "x"}, "--tls_server_name"},
           {{"--tls_ca", pem, "--tls_cert", not_pem, "--tls_key", pem}, "--tls_cert"},
           {{"--auth_token_file", dir + "/missing"}, "--auth_token_file"},
           {{"--operator_token_file", spaced}, "--operator_token_file"}}) {
    auto r = parse(bad.first);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad.second;
    EXPECT_NE(r.status().message().find(bad.second), std::string::npos) << r.status();
  }
  // The credential flags are accepted by every dialing subcommand's parser, not by others.
  EXPECT_FALSE(CtlArgs::Parse({"--auth_token_file", token}, {{"addr"}, {}}).ok());
}

}  // namespace
}  // namespace wb::client

namespace wb::client {
namespace {

namespace pb = ::weightbridge::v1;

// A coordinator that records the StatusRequest filter of each ClusterStatus / WatchStatus and
// answers as the real one does: NOT_FOUND for a model it does not know, else a status of the
// filter's model, with model "qwen"'s older records trimmed unless the filter asked for it.
class FilterRecordingCoordinator final : public pb::CoordinatorService::Service {
 public:
  grpc::Status ClusterStatus(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    return Answer(*req, resp);
  }
  grpc::Status WatchStatus(grpc::ServerContext*, const pb::WatchStatusRequest* req,
                           grpc::ServerWriter<pb::StatusResponse>* writer) override {
    pb::StatusResponse resp;
    grpc::Status s = Answer(req->request(), &resp);
    if (!s.ok()) return s;
    writer->Write(resp);
    return grpc::Status::OK;  // the watch goes on unfiltered / times out: not what these tests look at
  }
  std::vector<pb::StatusRequest> requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }

 private:
  grpc::Status Answer(const pb::StatusRequest& req, pb::StatusResponse* resp) {
    {
      std::lock_guard<std::mutex> l(mu_);
      requests_.push_back(req);
    }
    if (!req.model_id().empty() && req.model_id() != "qwen") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "status filter: unknown model '" + req.model_id() + "'");
    }
    resp->set_role("coordinator");
    resp->add_nodes()->set_node_id("n0");
    pb::ModelStatus* m = resp->add_models();
    m->set_model_id("qwen");
    const uint64_t first = req.model_id().empty() ? 63 : 1;  // whole when filtered
    for (uint64_t v = first; v <= 64; ++v) {
      pb::VersionStatus* vs = resp->add_versions();
      vs->set_model_id("qwen");
      vs->set_version(v);
      vs->set_state(v == 64 ? "transferring" : "committed");
      vs->set_bytes_total(100);
    }
    if (req.model_id().empty()) {
      pb::StatusTrimmed* t = resp->mutable_trimmed();
      t->set_budget_bytes(3145728);
      t->set_bytes_before(4613734);
      t->set_versions_dropped(62);
      (*t->mutable_versions_dropped_by_model())["qwen"] = 62;
    }
    return grpc::Status::OK;
  }
  std::mutex mu_;
  std::vector<pb::StatusRequest> requests_;
};

class CtlFilterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    addr_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override { server_->Shutdown(); }
  pb::StatusRequest Last() {
    auto r = service_.requests();
    return r.empty() ? pb::StatusRequest() : r.back();
  }

  FilterRecordingCoordinator service_;
  std::unique_ptr<grpc::Server> server_;
  std::string addr_;
};

TEST_F(CtlFilterTest, StatusSendsModelAndNodeAndTheTrimmedLinePointsToModel) {
  std::ostringstream out, err;
  ASSERT_EQ(RunStatusCommand({"--addr", addr_}, out, err), kCtlOk) << err.str();
  EXPECT_TRUE(Last().model_id().empty());
  // Unfiltered and trimmed: the TRIMMED line points to --model for a model's older records.
  EXPECT_NE(out.str().find("TRIMMED: "), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("The rest: a model's older versions with --model M (wbctl status --model M, wbctl versions --model M)"),
            std::string::npos)
      << out.str();

  std::ostringstream fout, ferr;
  ASSERT_EQ(RunStatusCommand({"--addr", addr_, "--model", "qwen", "--node", "n0"}, fout, ferr), kCtlOk) << ferr.str();
  EXPECT_EQ(Last().model_id(), "qwen");
  EXPECT_EQ(Last().node_id(), "n0");
  EXPECT_NE(fout.str().find("filter: model qwen, node n0"), std::string::npos) << fout.str();
  EXPECT_EQ(fout.str().find("TRIMMED"), std::string::npos) << "filtered: whole\n" << fout.str();
  EXPECT_NE(fout.str().find("VERSIONS (64)"), std::string::npos) << fout.str();

  std::ostringstream jout, jerr;
  ASSERT_EQ(RunStatusCommand({"--addr", addr_, "--model", "qwen", "--json"}, jout, jerr), kCtlOk) << jerr.str();
  auto j = nlohmann::json::parse(jout.str());
  EXPECT_EQ(j["filter"]["model_id"], "qwen");
  EXPECT_TRUE(j["trimmed"].is_null());

  // An unknown model: the coordinator's NOT_FOUND, exit 6; an empty id is a usage error.
  std::ostringstream uout, uerr;
  EXPECT_EQ(RunStatusCommand({"--addr", addr_, "--model", "nope"}, uout, uerr), kCtlNotFound);
  EXPECT_NE(uerr.str().find("unknown model 'nope'"), std::string::npos) << uerr.str();
  EXPECT_EQ(RunStatusCommand({"--addr", addr_, "--model="}, uout, uerr), kCtlUsage);
}

TEST_F(CtlFilterTest, VersionsSendsTheModelSoItsRecordsAreWhole) {
  std::ostringstream out, err;
  ASSERT_EQ(RunVersionsCommand({"--addr", addr_, "--model", "qwen", "--json"}, out, err), kCtlOk) << err.str();
  EXPECT_EQ(Last().model_id(), "qwen") << "versions narrows the status at the coordinator, not only in wbctl";
  auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["versions"].size(), 64u) << out.str();
  EXPECT_EQ(j["versions_not_listed"].get<uint32_t>(), 0u);
  std::ostringstream uout, uerr;
  EXPECT_EQ(RunVersionsCommand({"--addr", addr_, "--model", "nope"}, uout, uerr), kCtlNotFound);
  EXPECT_NE(uerr.str().find("no model 'nope'"), std::string::npos) << uerr.str();
}

TEST_F(CtlFilterTest, WatchSendsTheModelAndWaitsUnfilteredForAModelNotKnownYet) {
  std::ostringstream out, err;
  // qwen v64 is transferring and stays so: the watch times out, having asked for qwen only.
  EXPECT_EQ(RunWatchCommand({"--addr", addr_, "--model", "qwen", "--timeout", "1s"}, out, err), kCtlWatchTimeout) << err.str();
  ASSERT_FALSE(service_.requests().empty());
  EXPECT_EQ(service_.requests().front().model_id(), "qwen");
  EXPECT_NE(out.str().find("qwen v64"), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("TRIMMED"), std::string::npos) << out.str();

  // A model the coordinator does not know: with --version, exit 6 at once; without, the watch
  // waits for it on the whole status (which is trimmed here: the line points to --model).
  std::ostringstream vout, verr;
  EXPECT_EQ(RunWatchCommand({"--addr", addr_, "--model", "later", "--version", "3", "--timeout", "1s"}, vout, verr), kCtlNotFound);
  EXPECT_NE(verr.str().find("no model 'later'"), std::string::npos) << verr.str();
  std::ostringstream wout, werr;
  const size_t before = service_.requests().size();
  EXPECT_EQ(RunWatchCommand({"--addr", addr_, "--model", "later", "--timeout", "1s"}, wout, werr), kCtlWatchTimeout) << werr.str();
  auto reqs = service_.requests();
  ASSERT_GE(reqs.size(), before + 2);
  EXPECT_EQ(reqs[before].model_id(), "later");
  EXPECT_TRUE(reqs[before + 1].model_id().empty()) << "the second watch is unfiltered";
  EXPECT_NE(wout.str().find("waiting for a version to start of later"), std::string::npos) << wout.str();
  EXPECT_NE(wout.str().find("with --model M"), std::string::npos) << wout.str();
}

// The TRIMMED line of a status asked for one model (that model alone over the budget) points to
// the coordinator log, not to --model again.
TEST(StatusViewTest, ATrimmedFilteredStatusPointsToTheLog) {
  pb::StatusResponse s;
  s.mutable_trimmed()->set_budget_bytes(1000);
  s.mutable_trimmed()->set_versions_dropped(5);
  (*s.mutable_trimmed()->mutable_versions_dropped_by_model())["qwen"] = 5;
  s.mutable_trimmed()->set_nodes_with_lists_cut(1);
  s.mutable_trimmed()->set_data_nics_dropped(4);
  pb::StatusRequest filter;
  filter.set_model_id("qwen");
  const std::string line = TrimmedLine(s, filter);
  EXPECT_NE(line.find("older versions of qwen (over the budget by itself) in the coordinator log"), std::string::npos) << line;
  EXPECT_NE(line.find("with --node N"), std::string::npos) << line;
  filter.set_node_id("n0");
  EXPECT_NE(TrimmedLine(s, filter).find("in that node daemon's flags"), std::string::npos) << TrimmedLine(s, filter);
}

}  // namespace
}  // namespace wb::client

// Hostile-client probe of every RPC (issue 15, beyond its numbered findings): each method of
// WorkerService, NodeService and CoordinatorService gets an empty request, a plausible one, and
// that plausible request with each field (three message levels deep) set to empty, huge (1 MiB
// strings, 20,000-element lists, 100,000-element repeated numbers) and out-of-range values
// (2^64-1, -1, INT_MIN, enum 99, NaN), against a real coordinator and two node daemons in this
// process (mTLS with per-node certificates + token, port 0). The probing client is a worker
// process on n0's socket and a node "n5" with its own certificate from the cluster CA (a buggy or
// compromised node), so the calls reach the handlers. Then: calls from where they do not belong
// (a worker on the worker socket calling NodeService / CoordinatorService, n5 naming n0 in every
// call a node makes about itself, no token, no certificate).
//
// What must hold for every answer: no UNKNOWN; INTERNAL only with a message; no message longer
// than 4 KiB (echoed values truncated) and none of gRPC's "metadata size" errors; no call that
// cannot block outlives its deadline (DEADLINE_EXCEEDED only from methods that wait by design).
// Afterwards: every daemon answers, each rollout's live memory is one whole version (or is
// reported torn), and a fresh model moves two versions byte for byte across both nodes.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/convert.h"
#include "daemon/limits.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "tests/common/test_certs.h"

namespace wb::daemon {
namespace {

// Map fields through protobuf's library code (reflection, text format): not under TSan. There,
// protobuf's map_field.h gives MapFieldBase two extra members (its own race checks) that Debian's
// uninstrumented libprotobuf was built without, so the library reads our map fields at the wrong
// offsets (a crash in TextFormat's parse of a map entry; docs/sanitizers.md). A TSan build probes
// every other field; every other build probes the maps too.
#if defined(__SANITIZE_THREAD__)
constexpr bool kLibraryMapsUsable = false;
#else
constexpr bool kLibraryMapsUsable = true;
#endif
// `text` (a map entry in text format) where the library may parse it, else nothing.
std::string MapEntry(const std::string& text) { return kLibraryMapsUsable ? text : std::string(); }

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::MethodDescriptor;
using google::protobuf::Reflection;
using google::protobuf::ServiceDescriptor;

// ------------------------------------------------------------------ request variants

using Nav = std::function<Message*(Message*)>;  // root copy -> the (sub)message a variant edits
struct Variant {
  std::string what;
  std::function<void(Message*)> edit;  // applied to a copy of the base request
};

const std::string& HugeString() {
  static const std::string s(size_t{1} << 20, 'x');
  return s;
}

// The edge values of one scalar field: each sets it (singular) or appends it (repeated).
using Setter = std::function<void(Message*, const FieldDescriptor*, bool add)>;
std::vector<std::pair<std::string, Setter>> Edges(const FieldDescriptor* f) {
  std::vector<std::pair<std::string, Setter>> e;
  auto i32 = [&](std::string l, int32_t v) {
    e.push_back({l, [v](Message* m, const FieldDescriptor* f, bool add) {
                   add ? m->GetReflection()->AddInt32(m, f, v) : m->GetReflection()->SetInt32(m, f, v);
                 }});
  };
  auto i64 = [&](std::string l, int64_t v) {
    e.push_back({l, [v](Message* m, const FieldDescriptor* f, bool add) {
                   add ? m->GetReflection()->AddInt64(m, f, v) : m->GetReflection()->SetInt64(m, f, v);
                 }});
  };
  auto u32 = [&](std::string l, uint32_t v) {
    e.push_back({l, [v](Message* m, const FieldDescriptor* f, bool add) {
                   add ? m->GetReflection()->AddUInt32(m, f, v) : m->GetReflection()->SetUInt32(m, f, v);
                 }});
  };
  auto u64 = [&](std::string l, uint64_t v) {
    e.push_back({l, [v](Message* m, const FieldDescriptor* f, bool add) {
                   add ? m->GetReflection()->AddUInt64(m, f, v) : m->GetReflection()->SetUInt64(m, f, v);
                 }});
  };
  auto str = [&](std::string l, std::string v) {
    e.push_back({l, [v](Message* m, const FieldDescriptor* f, bool add) {
                   add ? m->GetReflection()->AddString(m, f, v) : m->GetReflection()->SetString(m, f, v);
                 }});
  };
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      i32("-1", -1), i32("INT32_MIN", std::numeric_limits<int32_t>::min()), i32("INT32_MAX", std::numeric_limits<int32_t>::max());
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      i64("-1", -1), i64("INT64_MIN", std::numeric_limits<int64_t>::min()), i64("INT64_MAX", std::numeric_limits<int64_t>::max());
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      u32("0", 0), u32("UINT32_MAX", std::numeric_limits<uint32_t>::max());
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      u64("0", 0), u64("2^64-1", ~uint64_t{0}), u64("2^63", uint64_t{1} << 63), u64("2^53+1", (uint64_t{1} << 53) + 1);
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT:
      for (double v : {std::nan(""), -std::numeric_limits<double>::infinity(), 1e308}) {
        e.push_back({absl::StrCat(v), [v](Message* m, const FieldDescriptor* f, bool add) {
                       const Reflection* r = m->GetReflection();
                       if (f->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT) {
                         add ? r->AddFloat(m, f, static_cast<float>(v)) : r->SetFloat(m, f, static_cast<float>(v));
                       } else {
                         add ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
                       }
                     }});
      }
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      e.push_back({"true", [](Message* m, const FieldDescriptor* f, bool add) {
                     add ? m->GetReflection()->AddBool(m, f, true) : m->GetReflection()->SetBool(m, f, true);
                   }});
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      for (int v : {99, -1}) {
        e.push_back({absl::StrCat("enum ", v), [v](Message* m, const FieldDescriptor* f, bool add) {
                       add ? m->GetReflection()->AddEnumValue(m, f, v) : m->GetReflection()->SetEnumValue(m, f, v);
                     }});
      }
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      str("empty", "");
      str("1 MiB", HugeString());
      if (f->type() == FieldDescriptor::TYPE_BYTES) {
        str("garbage bytes", std::string("\xff\x00\x01garbage", 10));
      } else {
        str("CR LF NUL", std::string("a\r\nb\0c", 6));
        str("path", "../../../../etc/passwd");
        str("/", "/");
      }
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return e;
}

// Variants of `base`: every field at every edge value, nested messages up to `depth` levels.
void CollectVariants(const Descriptor* d, const std::string& path, const Nav& nav, int depth, std::vector<Variant>* out) {
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string p = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    if (f->is_map() && !kLibraryMapsUsable) continue;
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        out->push_back({p + " x20000 empty", [nav, f](Message* root) {
                          Message* m = nav(root);
                          for (int k = 0; k < 20000; ++k) m->GetReflection()->AddMessage(m, f);
                        }});
        out->push_back({p + " cleared", [nav, f](Message* root) {
                          Message* m = nav(root);
                          m->GetReflection()->ClearField(m, f);
                        }});
        if (depth > 0) {
          Nav inner = [nav, f](Message* root) {
            Message* m = nav(root);
            const Reflection* r = m->GetReflection();
            if (r->FieldSize(*m, f) == 0) r->AddMessage(m, f);
            return r->MutableRepeatedMessage(m, f, 0);
          };
          CollectVariants(f->message_type(), p + "[0]", inner, depth - 1, out);
        }
      } else if (depth > 0) {
        Nav inner = [nav, f](Message* root) {
          Message* m = nav(root);
          return m->GetReflection()->MutableMessage(m, f);
        };
        CollectVariants(f->message_type(), p, inner, depth - 1, out);
      }
      continue;
    }
    for (auto& [label, set] : Edges(f)) {
      if (!f->is_repeated()) {
        out->push_back({p + "=" + label, [nav, f, set = set](Message* root) { set(nav(root), f, false); }});
        continue;
      }
      out->push_back({p + " += " + label, [nav, f, set = set](Message* root) { set(nav(root), f, true); }});
    }
    if (f->is_repeated()) {
      const auto edges = Edges(f);
      if (!edges.empty()) {
        // 100,000 elements; strings small each (the 1 MiB case is above).
        const Setter many = f->cpp_type() == FieldDescriptor::CPPTYPE_STRING
                                ? Setter([](Message* m, const FieldDescriptor* f, bool) { m->GetReflection()->AddString(m, f, "s"); })
                                : edges.back().second;
        out->push_back({p + " x100000", [nav, f, many](Message* root) {
                          Message* m = nav(root);
                          for (int k = 0; k < 100000; ++k) many(m, f, true);
                        }});
      }
      out->push_back({p + " cleared", [nav, f](Message* root) {
                        Message* m = nav(root);
                        m->GetReflection()->ClearField(m, f);
                      }});
    }
  }
}

// ------------------------------------------------------------------ one call, judged

struct Outcome {
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  absl::Duration took;
};

constexpr absl::Duration kCallDeadline = absl::Seconds(8);

Outcome CallGeneric(const std::shared_ptr<grpc::Channel>& channel, const std::string& method, const std::string& body) {
  grpc::GenericStub generic(channel);
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  grpc::CompletionQueue cq;
  grpc::Status status;
  const absl::Time t0 = absl::Now();
  auto call = generic.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  (void)cq.Next(&tag, &ok);
  Outcome o{status.error_code(), status.error_message(), absl::Now() - t0};
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return o;
}

// WatchStatus streams: read until the server ends it (its timeout) or the deadline.
Outcome CallWatch(const std::shared_ptr<grpc::Channel>& channel, const std::string& body) {
  pb::WatchStatusRequest req;
  if (!req.ParseFromString(body)) return {grpc::StatusCode::OK, "", absl::ZeroDuration()};  // the generic path covers garbage
  auto stub = pb::CoordinatorService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
  const absl::Time t0 = absl::Now();
  auto reader = stub->WatchStatus(&ctx, req);
  pb::StatusResponse resp;
  while (reader->Read(&resp)) {
  }
  grpc::Status s = reader->Finish();
  return {s.error_code(), s.error_message(), absl::Now() - t0};
}

// Methods that wait by design (for a version, a drain, a trainer's turn, a stream's timeout):
// DEADLINE_EXCEEDED is their legitimate answer to a long request timeout.
bool MayBlock(const std::string& method) {
  static const std::set<std::string> blocking = {
      "WorkerService/Publish",         "WorkerService/BeginUpdate",       "WorkerService/Apply",
      "WorkerService/WaitVersion",     "WorkerService/EndUpdate",     "CoordinatorService/WaitVersion",  "CoordinatorService/Publish",
      "CoordinatorService/Drain",      "CoordinatorService/WatchStatus",  "NodeService/Drain",
      "NodeService/ExecuteVersion",    "NodeService/SetupDataChannel",    "NodeService/ExchangeRegions",
      "CoordinatorService/ReportReady"};
  for (const std::string& b : blocking) {
    if (method.size() >= b.size() && method.compare(method.size() - b.size(), b.size(), b) == 0) return true;
  }
  return false;
}

// What a hostile client may never see. Returns "" when the answer is acceptable.
std::string Judge(const std::string& method, const Outcome& o) {
  if (o.code == grpc::StatusCode::UNKNOWN) return absl::StrCat("UNKNOWN: ", o.message.substr(0, 300));
  if (o.code == grpc::StatusCode::INTERNAL && o.message.empty()) return "INTERNAL without a message";
  if (o.code != grpc::StatusCode::OK && o.message.empty() && o.code != grpc::StatusCode::DEADLINE_EXCEEDED &&
      o.code != grpc::StatusCode::CANCELLED) {
    return absl::StrCat("code ", o.code, " without a message");
  }
  if (o.message.size() > 4096) return absl::StrCat("error message of ", o.message.size(), " bytes (echoed value not truncated)");
  if (o.message.find("metadata") != std::string::npos) return absl::StrCat("gRPC metadata error: ", o.message.substr(0, 300));
  if (o.code == grpc::StatusCode::DEADLINE_EXCEEDED && !MayBlock(method)) return "hung until the client's deadline";
  return "";
}

// ------------------------------------------------------------------ the cluster

class RpcProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/rpc-probe-certs";
    ASSERT_EQ(MakeTestCerts(dir_, {"coordinator", "n0", "n1", "n5"}, "wb-probe-ca", {{"token", "probe-token"}, {"wrong", "wrong-token"}}), "");
    spec_ = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
    if (standalone_) {
      // One process in both roles (the probe's SIGBUS took the coordinator role down there too).
      ServerOptions so;
      so.role = DaemonRole::kStandalone;
      so.worker_socket = absl::StrCat("/tmp/wbprobe-sa-", ::getpid(), ".sock");
      so.make_transports = HostTransports;
      so.security.peer_auth = Auth("coordinator");
      so.node_id = "coordinator";  // its node registers with its own coordinator under its certificate's name
      auto server = Server::Start(so);
      ASSERT_TRUE(server.ok()) << server.status();
      c_.nodes_.push_back(std::move(*server));
      coord_server_ = c_.nodes_[0].get();
      spec_.set_num_trainer_workers(1);
      spec_.set_num_rollout_workers(1);
      const std::vector<PieceDef> whole = {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}};
      trainers_ = {&c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, whole))};
      rollouts_ = {&c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, whole))};
    } else {
      c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [&](ServerOptions& o) { o.security.peer_auth = Auth("coordinator"); });
      for (int n : {0, 1}) {
        c_.StartNode(n, nullptr, nullptr, [&, n](ServerOptions& o) {
          auto auth = Auth(absl::StrCat("n", n));
          auth->coordinator_identity = "coordinator";  // as main.cc sets it from --tls_server_name / --coordinator
          o.security.peer_auth = auth;
        });
      }
      ASSERT_FALSE(HasFatalFailure());
      coord_server_ = c_.coord_.get();
      TwoNodeWorkers w = AddTwoNodeWorkers(c_, inv_);
      trainers_ = {&w.t0, &w.t1};
      rollouts_ = {&w.r0, &w.r1};
    }
    for (TestWorker* x : trainers_) ASSERT_TRUE(c_.Register(*x, spec_).ok()) << x->id;
    for (TestWorker* x : rollouts_) ASSERT_TRUE(c_.Register(*x, spec_).ok()) << x->id;
    pb::ApplyResponse resp;
    for (auto& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, trainers_, rollouts_)) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : rollouts_) {
      ASSERT_TRUE(c_.Apply(*r, "m", 1, &resp).ok()) << r->id;
      ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
    }
    // Whatever the probe publishes carries version 2's bytes.
    for (TestWorker* t : trainers_) Fill(*t, 2);
    n5_ = Auth("n5");
    worker_channel_ = grpc::CreateChannel("unix:" + c_.nodes_[0]->worker_socket(), grpc::InsecureChannelCredentials());
    coord_channel_ = MakePeerChannel(coord_server_->address(), *n5_, int64_t{512} << 20);
    // NodeService as a buggy coordinator (its certificate; another node's is refused, see
    // CallsFromWhereTheyDoNotBelongAreRefused), on a model of its own ("pm"): a coordinator may
    // install any plan for a model, so m's live memory is not its to probe.
    node_channel_ = MakePeerChannel(c_.nodes_[0]->address(), *Auth("coordinator"), int64_t{512} << 20);
  }
  void TearDown() override { c_.Stop(); }
  // Every method: empty, plausible, each field at each edge value, and a body that is no protobuf;
  // then the daemons must answer, live memory must be whole, and a fresh model must move versions.
  void ProbeEverything();

  std::shared_ptr<PeerAuthConfig> Auth(const std::string& name, const std::string& token = "token") {
    auto auth = LoadPeerAuth(dir_ + "/" + name + ".pem", dir_ + "/" + name + ".key", dir_ + "/ca.pem", dir_ + "/" + token);
    EXPECT_TRUE(auth.ok()) << auth.status();
    return auth.ok() ? std::make_shared<PeerAuthConfig>(*auth) : std::make_shared<PeerAuthConfig>();
  }

  // r0's layout as RegisterLayout / SubmitLayout carry it.
  void FillLayout(google::protobuf::RepeatedPtrField<pb::BufferSpec>* buffers, pb::LayoutSpec* layout) {
    const TestWorker& r0 = *rollouts_[0];
    pb::BufferSpec* b = buffers->Add();
    b->set_buffer_id(7);
    b->set_size_bytes(static_cast<uint64_t>(r0.seg.size()));
    b->set_shm_name(r0.seg.name());
    b->set_gpu(-1);
    for (const planner::Piece& p : r0.layout.pieces) {
      pb::Piece* pp = layout->mutable_pieces()->add_pieces();
      pp->set_tensor(inv_.tensors[p.tensor].name);
      ToProto(p.box, pp->mutable_box());
      pp->set_buffer_id(7);
      pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
      for (int64_t st : p.strides) pp->add_strides(st);
    }
  }

  // A plausible request per method: the real model, workers and nodes, so that edits reach the
  // handlers' deeper checks. Methods not listed start from the empty request.
  std::unique_ptr<Message> Base(const MethodDescriptor* m) {
    std::unique_ptr<Message> msg(google::protobuf::MessageFactory::generated_factory()->GetPrototype(m->input_type())->New());
    const std::string name = absl::StrCat(m->service()->name(), "/", m->name());
    auto text = [&](const std::string& t) { EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(t, msg.get())) << name; };
    const std::string slice =
        "slice { model_id: 'pm' plan_epoch: 1000 fingerprint: 'f' strategy: STRATEGY_WEIGHTBRIDGE mode: MODE_ONE_STEP_OFF "
        "tensors { name: 'a' shape: 8 shape: 16 dtype: DTYPE_F32 } "
        "workers { worker_id: 'r0' role: ROLE_ROLLOUT node_id: 'n0' gpu: -1 data_address: '127.0.0.1:1' "
        "  layout { buffers { buffer_id: 7 size_bytes: 512 shm_name: '/wb-probe-none' gpu: -1 } "
        "    pieces { tensor: 'a' box { begin: 0 begin: 0 end: 8 end: 16 } buffer_id: 7 strides: 16 strides: 1 } } "
        "  " + MapEntry("transport_instances { key: 'host_tcp' value: 'x' }") + " } "
        "ops { index: 0 bucket: 0 src_worker: 0 dst_worker: 0 src_piece: 0 dst_piece: 0 tensor: 0 "
        "  box { begin: 0 begin: 0 end: 8 end: 16 } bytes: 512 route: ROUTE_SAME_GPU } "
        "num_buckets: 1 total_bytes: 512 }";
    if (name == "WorkerService/RegisterWorker") {
      text("model_id: 'm' worker_id: 'p0' role: ROLE_ROLLOUT gpu: -1");
      *static_cast<pb::RegisterWorkerRequest*>(msg.get())->mutable_model() = spec_;
    } else if (name == "WorkerService/RegisterLayout") {
      auto* r = static_cast<pb::RegisterLayoutRequest*>(msg.get());
      text("model_id: 'm' worker_id: 'r0'");
      FillLayout(r->mutable_buffers(), r->mutable_layout());
    } else if (name == "WorkerService/DescribeLayout") {
      auto* r = static_cast<pb::DescribeLayoutRequest*>(msg.get());
      text("model_id: 'm' worker_id: 'r0' role: ROLE_ROLLOUT");
      *r->mutable_model() = spec_;
      google::protobuf::RepeatedPtrField<pb::BufferSpec> unused;
      FillLayout(&unused, r->mutable_layout());
    } else if (name == "WorkerService/Publish") {
      text("model_id: 'm' worker_id: 't0' version: 1000 timeout_ms: 200");
    } else if (name == "WorkerService/BeginUpdate") {
      text("model_id: 'm' worker_id: 'r0' timeout_ms: 200");
    } else if (name == "WorkerService/EndUpdate") {
      text("model_id: 'm' worker_id: 'r0' timeout_ms: 200");
    } else if (name == "WorkerService/Apply") {
      text("model_id: 'm' worker_id: 'r0' version: 1 timeout_ms: 2000");
    } else if (name == "WorkerService/WaitVersion" || name == "CoordinatorService/WaitVersion") {
      text("model_id: 'm' version: 1 timeout_ms: 200 worker_id: 'r0'");
    } else if (name == "WorkerService/Deregister") {
      text("model_id: 'm' worker_id: 'p0'");
    } else if (name == "NodeService/InstallPlan") {
      text(slice);
    } else if (name == "NodeService/ExecuteVersion") {
      text("model_id: 'pm' version: 1000 plan_epoch: 1000 timeout_ms: 500 coordinator_instance: 'x'");
    } else if (name == "NodeService/CommitVersion" || name == "NodeService/AbortVersion") {
      text("model_id: 'pm' version: 1000");
    } else if (name == "NodeService/DropWorker") {
      text("model_id: 'pm' worker_id: 'p0' reason: 'probe'");
    } else if (name == "NodeService/SetupDataChannel") {
      text("peer_node_id: 'n5' endpoint: '127.0.0.1:1' transport_descriptor: 'x'");
    } else if (name == "NodeService/ExchangeRegions") {
      text("model_id: 'pm' version: 1000 plan_epoch: 1000 from_node: 'n5' transport_kind: 'host_tcp' endpoint: 'x' "
           "regions { key: 'k' region_descriptor: 'x' } from_transport: 'host_tcp'");
    } else if (name == "NodeService/Drain" || name == "CoordinatorService/Drain") {
      text("node_id: 'n5' timeout_ms: 200");
    } else if (name == "CoordinatorService/RegisterNode") {
      text("node_id: 'n5' address: '127.0.0.1:1' data_address: '127.0.0.1:1' " +
           MapEntry("transport_instances { key: 'host_tcp' value: 'x' } ") + "heartbeat_ms: 100 data_nics: '127.0.0.1'");
    } else if (name == "CoordinatorService/Heartbeat") {
      text("node_id: 'n5' incarnation: 1 progress { model_id: 'm' version: 1000 bytes_done: 10 }");
    } else if (name == "CoordinatorService/CreateModel") {
      *static_cast<pb::CreateModelRequest*>(msg.get())->mutable_model() = spec_;
      static_cast<pb::CreateModelRequest*>(msg.get())->mutable_model()->set_model_id("pm");
    } else if (name == "CoordinatorService/JoinWorker") {
      text("node_id: 'n5' worker_id: 'x0' model_id: 'pm' role: ROLE_ROLLOUT gpu: -1");
      *static_cast<pb::JoinWorkerRequest*>(msg.get())->mutable_model() = spec_;
      static_cast<pb::JoinWorkerRequest*>(msg.get())->mutable_model()->set_model_id("pm");
    } else if (name == "CoordinatorService/SubmitLayout") {
      auto* r = static_cast<pb::SubmitLayoutRequest*>(msg.get());
      text("node_id: 'n5' model_id: 'pm' worker_id: 'x0'");
      FillLayout(r->mutable_buffers(), r->mutable_layout());
    } else if (name == "CoordinatorService/LeaveWorker") {
      text("node_id: 'n5' model_id: 'pm' worker_id: 'x0' reason: 'probe'");
    } else if (name == "CoordinatorService/Publish") {
      // A node publishing for a trainer that lives on another node.
      text("node_id: 'n5' model_id: 'm' worker_id: 't0' version: 1000 timeout_ms: 200");
    } else if (name == "CoordinatorService/ReportReady") {
      text("node_id: 'n5' model_id: 'm' worker_id: 'r0'");
    } else if (name == "CoordinatorService/ReportDone") {
      text("node_id: 'n5' model_id: 'm' version: 1 ok: true bytes: 512 seconds: 0.1 coordinator_instance: 'x' "
           "source_digests { op: 0 digest: 1 } landed_digests { op: 0 digest: 2 }");
    } else if (name == "CoordinatorService/ReportApplied") {
      text("node_id: 'n5' model_id: 'm' worker_id: 'r0' version: 1");
    } else if (name == "CoordinatorService/ExchangeMagnitudes") {
      // A node that holds no NVFP4 piece, naming a tensor that does not exist, asking to wait.
      text("node_id: 'n5' model_id: 'm' version: 1 wait: true timeout_ms: 200 "
           "parts { tensor: 'no.such.weight' amax: 1e30 }");
    } else if (name == "CoordinatorService/Plan") {
      text("model_id: 'm'");
    } else if (name == "CoordinatorService/WatchStatus") {
      text("timeout_ms: 200");
    }
    return msg;
  }

  const std::shared_ptr<grpc::Channel>& ChannelFor(const ServiceDescriptor* s) {
    if (s->name() == "WorkerService") return worker_channel_;
    if (s->name() == "NodeService") return node_channel_;
    return coord_channel_;
  }

  planner::Inventory inv_ = SmallInventory();
  bool standalone_ = false;  // one standalone daemon instead of a coordinator and two nodes
  Cluster c_;
  Server* coord_server_ = nullptr;  // the process serving CoordinatorService
  pb::ModelSpec spec_;
  std::vector<TestWorker*> trainers_, rollouts_;
  std::string dir_;
  std::shared_ptr<PeerAuthConfig> n5_;
  std::shared_ptr<grpc::Channel> worker_channel_, coord_channel_, node_channel_;
};

const ServiceDescriptor* Service(const std::string& name) {
  return pb::StatusRequest::descriptor()->file()->FindServiceByName(name);
}
const std::vector<const ServiceDescriptor*>& Services() {
  static const std::vector<const ServiceDescriptor*> s = {Service("WorkerService"), Service("NodeService"), Service("CoordinatorService")};
  return s;
}

// Every method: empty, plausible, and each field at each edge value. Then the daemons must answer,
// live memory must be whole, and a fresh model must move versions byte for byte.
void RpcProbeTest::ProbeEverything() {
  // A node of the probe's own (n5, unreachable address) so node-scoped calls reach the handlers.
  {
    auto stub = pb::CoordinatorService::NewStub(coord_channel_);
    grpc::ClientContext ctx;
    pb::RegisterNodeRequest req;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString("node_id: 'n5' address: '127.0.0.1:1' data_address: '127.0.0.1:1'", &req));
    pb::RegisterNodeResponse resp;
    grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
    if (!standalone_) {
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
  }
  struct Job {
    const MethodDescriptor* method;
    std::shared_ptr<const Message> base;
    Variant variant;
    std::string raw;  // sent as is instead of the edited base (a body that is no protobuf)
  };
  std::vector<Job> jobs;
  std::map<std::string, int> per_method;
  for (const ServiceDescriptor* s : Services()) {
    for (int i = 0; i < s->method_count(); ++i) {
      const MethodDescriptor* m = s->method(i);
      std::shared_ptr<const Message> base = Base(m);
      jobs.push_back({m, base, {"(empty request)", [](Message* root) { root->Clear(); }}});
      jobs.push_back({m, base, {"(plausible request)", [](Message*) {}}});
      jobs.push_back({m, base, {"(garbage body)", nullptr}, std::string("\xff\xff\xff\xff\x0f garbage", 14)});
      std::vector<Variant> vs;
      CollectVariants(m->input_type(), "", [](Message* root) { return root; }, 3, &vs);
      for (Variant& v : vs) jobs.push_back({m, base, std::move(v)});
      per_method[absl::StrCat(s->name(), "/", m->name())] = static_cast<int>(vs.size()) + 2;
    }
  }
  // Interleave methods (a stride through the list) so calls of one method do not run back to back.
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::map<grpc::StatusCode, int> codes;
  const size_t n = jobs.size();
  const size_t stride = 7919;  // prime, coprime with n unless n is a multiple of it
  ASSERT_NE(n % stride, 0u);
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 24; ++t) {
    threads.emplace_back([&] {
      for (size_t k = next++; k < n; k = next++) {
        const Job& job = jobs[(k * stride) % n];
        std::string body = job.raw;
        if (body.empty()) {
          std::unique_ptr<Message> req(job.base->New());
          req->CopyFrom(*job.base);
          job.variant.edit(req.get());
          body = req->SerializeAsString();
        }
        const std::string method = absl::StrCat("/", job.method->service()->full_name(), "/", job.method->name());
        const std::shared_ptr<grpc::Channel>& ch = ChannelFor(job.method->service());
        const Outcome o = job.method->server_streaming() && job.raw.empty() ? CallWatch(ch, body) : CallGeneric(ch, method, body);
        const std::string bad = Judge(method, o);
        absl::MutexLock l(&mu);
        codes[o.code]++;
        if (!bad.empty()) failures.push_back(absl::StrCat(method, " ", job.variant.what, ": ", bad));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::string summary;
  for (auto& [code, count] : codes) absl::StrAppend(&summary, " code ", code, ": ", count, ";");
  std::cerr << "probed " << n << " calls over " << per_method.size() << " methods in " << absl::Now() - start << ":" << summary << "\n";
  for (size_t i = 0; i < failures.size() && i < 40; ++i) ADD_FAILURE() << failures[i];
  EXPECT_TRUE(failures.empty()) << failures.size() << " bad answers of " << n;

  // Undo what the probe may have done to the cluster as a whole (drains, the fake node).
  {
    auto stub = pb::CoordinatorService::NewStub(coord_channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    pb::DrainRequest req;
    req.set_all(true);
    req.set_undo(true);
    pb::DrainResponse resp;
    grpc::Status s = stub->Drain(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  // Every daemon still answers.
  std::vector<Server*> daemons;
  if (c_.coord_) daemons.push_back(c_.coord_.get());
  for (auto& n : c_.nodes_) daemons.push_back(n.get());
  for (Server* srv : daemons) {
    auto stub = pb::CoordinatorService::NewStub(MakePeerChannel(srv->address(), *n5_));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::StatusResponse resp;
    grpc::Status s = srv == coord_server_ ? stub->ClusterStatus(&ctx, pb::StatusRequest(), &resp)
                                            : pb::NodeService::NewStub(MakePeerChannel(srv->address(), *n5_))
                                                  ->Status(&ctx, pb::StatusRequest(), &resp);
    EXPECT_TRUE(s.ok()) << srv->address() << ": " << s.error_message();
  }
  // No rollout's live memory is a mix: each holds version 1 or 2 whole, or says it is torn.
  for (TestWorker* r : rollouts_) {
    const pb::WorkerStatus ws = LocalStatus(c_, *r);
    if (ws.live_state() == "torn") {
      EXPECT_FALSE(ws.live_detail().empty()) << r->id;
      continue;
    }
    EXPECT_NE(ws.live_state(), "copying") << r->id << " still copying after the probe";
    EXPECT_TRUE(CountBad(*r, 1) == 0 || CountBad(*r, 2) == 0)
        << r->id << " holds a mix of versions (" << CountBad(*r, 1) << " elements differ from v1, " << CountBad(*r, 2)
        << " from v2) and its status says '" << ws.live_state() << "'";
  }
  // A fresh model on the same daemons moves two versions byte for byte across both nodes.
  pb::ModelSpec spec2 = spec_;
  spec2.set_model_id("m2");
  std::vector<TestWorker*> a, b;
  if (standalone_) {
    const std::vector<PieceDef> whole = {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}};
    a = {&c_.AddWorker("a0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, whole))};
    b = {&c_.AddWorker("b0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, whole))};
  } else {
    a = {&c_.AddWorker("a0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}})),
         &c_.AddWorker("a1", pb::ROLE_TRAINER, 1, &inv_, LayoutOf(inv_, {{0, {4, 0}, {8, 16}, false}}))};
    b = {&c_.AddWorker("b0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}})),
         &c_.AddWorker("b1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}))};
  }
  for (TestWorker* x : a) ASSERT_TRUE(c_.Register(*x, spec2).ok()) << x->id;
  for (TestWorker* x : b) ASSERT_TRUE(c_.Register(*x, spec2).ok()) << x->id;
  pb::ApplyResponse resp;
  for (uint64_t v : {1, 2}) {
    for (auto& s : c_.Publish("m2", pb::MODE_ONE_STEP_OFF, v, a, b)) ASSERT_TRUE(s.ok()) << "m2 v" << v << ": " << s.error_message();
    for (TestWorker* r : b) {
      grpc::Status s = c_.Apply(*r, "m2", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " v" << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " v" << v;
    }
  }
}

TEST_F(RpcProbeTest, EveryRpcSurvivesEmptyHugeAndOutOfRangeFields) { ProbeEverything(); }

// The same probe against one standalone daemon (coordinator and node roles in one process).
class StandaloneRpcProbeTest : public RpcProbeTest {
 protected:
  StandaloneRpcProbeTest() { standalone_ = true; }
};
TEST_F(StandaloneRpcProbeTest, EveryRpcSurvivesEmptyHugeAndOutOfRangeFields) { ProbeEverything(); }

// Calls from where they do not belong: a worker (on the worker socket) calling the daemons' TCP
// services, a node naming another node in every call a node makes about itself, a caller with
// the CA's certificate but a wrong token, and one with no certificate at all.
TEST_F(RpcProbeTest, CallsFromWhereTheyDoNotBelongAreRefused) {
  // The worker socket serves WorkerService only.
  for (const ServiceDescriptor* s : {Service("NodeService"), Service("CoordinatorService")}) {
    for (int i = 0; i < s->method_count(); ++i) {
      const std::string method = absl::StrCat("/", s->full_name(), "/", s->method(i)->name());
      const Outcome o = CallGeneric(worker_channel_, method, "");
      EXPECT_TRUE(o.code == grpc::StatusCode::UNIMPLEMENTED || o.code == grpc::StatusCode::PERMISSION_DENIED)
          << method << " on the worker socket: " << o.code << " " << o.message;
    }
  }
  // n5 naming n0: every node-scoped call is PERMISSION_DENIED naming both, and n0 is unaffected.
  const std::vector<std::pair<std::string, std::string>> scoped = {
      {"RegisterNode", "node_id: 'n0' address: '127.0.0.1:1'"},
      {"Heartbeat", "node_id: 'n0' incarnation: 1"},
      {"JoinWorker", "node_id: 'n0' worker_id: 'r0' model_id: 'm' role: ROLE_ROLLOUT"},
      {"SubmitLayout", "node_id: 'n0' model_id: 'm' worker_id: 'r0'"},
      {"LeaveWorker", "node_id: 'n0' model_id: 'm' worker_id: 'r0'"},
      {"Publish", "node_id: 'n0' model_id: 'm' worker_id: 't0' version: 5 timeout_ms: 100"},
      {"ReportReady", "node_id: 'n0' model_id: 'm' worker_id: 'r0'"},
      {"ReportDone", "node_id: 'n0' model_id: 'm' version: 1 ok: false error: 'forged'"},
      {"ReportApplied", "node_id: 'n0' model_id: 'm' worker_id: 'r0' version: 1"},
      {"ExchangeMagnitudes", "node_id: 'n0' model_id: 'm' version: 1 wait: true timeout_ms: 100"},
  };
  for (const auto& [name, text] : scoped) {
    const MethodDescriptor* m = Service("CoordinatorService")->FindMethodByName(name);
    ASSERT_NE(m, nullptr) << name;
    std::unique_ptr<Message> req(google::protobuf::MessageFactory::generated_factory()->GetPrototype(m->input_type())->New());
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, req.get())) << name;
    const Outcome o = CallGeneric(coord_channel_, absl::StrCat("/", m->service()->full_name(), "/", name), req->SerializeAsString());
    EXPECT_EQ(o.code, grpc::StatusCode::PERMISSION_DENIED) << name << ": " << o.message;
    EXPECT_NE(o.message.find("'n0'"), std::string::npos) << name << ": " << o.message;
    EXPECT_NE(o.message.find("n5"), std::string::npos) << name << ": " << o.message;
  }
  // n1 under its own name acting on n0's workers (publishing n0's trainer, pausing, dropping,
  // re-laying-out, advancing or taking over n0's rollout): PERMISSION_DENIED naming n0. A re-join
  // claiming version 2^64 - 1 committed is refused (it blocked every later publish and made
  // waiters see versions never sent); a failure report for a version not transferring changes
  // nothing (it left an aborted record that failed version 2's publish below).
  if (!standalone_) {
    auto n1_coord = MakePeerChannel(coord_server_->address(), *Auth("n1"), int64_t{256} << 20);
    const std::vector<std::tuple<std::string, std::string, grpc::StatusCode>> foreign = {
        {"Publish", "node_id: 'n1' model_id: 'm' worker_id: 't0' version: 2 timeout_ms: 100", grpc::StatusCode::PERMISSION_DENIED},
        {"ReportReady", "node_id: 'n1' model_id: 'm' worker_id: 'r0'", grpc::StatusCode::PERMISSION_DENIED},
        // ReportReadyRequest.resumed (thirty-sixth session): resuming another node's rollout (the
        // next sync version would wait for a BeginUpdate it already sent) is refused the same way.
        {"ReportReady", "node_id: 'n1' model_id: 'm' worker_id: 'r0' resumed: true", grpc::StatusCode::PERMISSION_DENIED},
        {"LeaveWorker", "node_id: 'n1' model_id: 'm' worker_id: 'r0'", grpc::StatusCode::PERMISSION_DENIED},
        {"ReportApplied", "node_id: 'n1' model_id: 'm' worker_id: 'r0' version: 18446744073709551615", grpc::StatusCode::PERMISSION_DENIED},
        {"SubmitLayout", "node_id: 'n1' model_id: 'm' worker_id: 'r0'", grpc::StatusCode::PERMISSION_DENIED},
        {"JoinWorker", "node_id: 'n1' worker_id: 'r0' model_id: 'm' role: ROLE_ROLLOUT", grpc::StatusCode::PERMISSION_DENIED},
        {"JoinWorker", "node_id: 'n1' worker_id: 'ghost' model_id: 'm' role: ROLE_ROLLOUT rejoin: true committed_version: 18446744073709551615",
         grpc::StatusCode::INVALID_ARGUMENT},
        {"ReportDone", "node_id: 'n1' model_id: 'm' version: 2 ok: false error: 'forged'", grpc::StatusCode::OK},
    };
    for (const auto& [name, text, want] : foreign) {
      const MethodDescriptor* m = Service("CoordinatorService")->FindMethodByName(name);
      ASSERT_NE(m, nullptr) << name;
      std::unique_ptr<Message> req(google::protobuf::MessageFactory::generated_factory()->GetPrototype(m->input_type())->New());
      ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, req.get())) << name;
      const Outcome o = CallGeneric(n1_coord, absl::StrCat("/", m->service()->full_name(), "/", name), req->SerializeAsString());
      EXPECT_EQ(o.code, want) << text << ": " << o.message;
      if (want == grpc::StatusCode::PERMISSION_DENIED) {
        EXPECT_NE(o.message.find("n0"), std::string::npos) << text << ": " << o.message;
      }
    }
  }
  // n5 calling n0's coordinator-only NodeService methods: PERMISSION_DENIED naming the coordinator
  // (before: a node's certificate installed a plan covering part of r0 and committed it, and r0's
  // Apply made its live weights part version 1, part the forged version).
  const std::vector<std::pair<std::string, std::string>> coordinator_only = {
      {"InstallPlan", "slice { model_id: 'm' plan_epoch: 1000 }"},
      {"ExecuteVersion", "model_id: 'm' version: 1000 plan_epoch: 1000 timeout_ms: 100"},
      {"CommitVersion", "model_id: 'm' version: 1"},
      {"AbortVersion", "model_id: 'm' version: 2"},
      {"DropWorker", "model_id: 'm' worker_id: 'r0'"},
  };
  auto n5_to_n0 = MakePeerChannel(c_.nodes_[0]->address(), *n5_);
  for (const auto& [name, text] : coordinator_only) {
    const MethodDescriptor* m = Service("NodeService")->FindMethodByName(name);
    ASSERT_NE(m, nullptr) << name;
    std::unique_ptr<Message> req(google::protobuf::MessageFactory::generated_factory()->GetPrototype(m->input_type())->New());
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, req.get())) << name;
    const Outcome o = CallGeneric(n5_to_n0, absl::StrCat("/", m->service()->full_name(), "/", name), req->SerializeAsString());
    EXPECT_EQ(o.code, grpc::StatusCode::PERMISSION_DENIED) << name << ": " << o.message;
    EXPECT_NE(o.message.find("coordinator"), std::string::npos) << name << ": " << o.message;
    EXPECT_NE(o.message.find("n5"), std::string::npos) << name << ": " << o.message;
  }
  // n5 exchanging regions with n0 as n1 (replacing n1's endpoint for a version in flight):
  // PERMISSION_DENIED naming both.
  {
    pb::ExchangeRegionsRequest x;
    x.set_model_id("m");
    x.set_version(3);
    x.set_plan_epoch(1);
    x.set_from_node("n1");
    x.set_transport_kind("host_tcp");
    const Outcome o = CallGeneric(n5_to_n0, "/weightbridge.v1.NodeService/ExchangeRegions", x.SerializeAsString());
    EXPECT_EQ(o.code, grpc::StatusCode::PERMISSION_DENIED) << o.message;
    EXPECT_NE(o.message.find("'n1'"), std::string::npos) << o.message;
    EXPECT_NE(o.message.find("n5"), std::string::npos) << o.message;
  }
  // n0 and its workers still work: version 2 reaches both rollouts whole.
  pb::ApplyResponse resp;
  for (auto& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 2, trainers_, rollouts_)) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : rollouts_) {
    ASSERT_TRUE(c_.Apply(*r, "m", 2, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  // The CA's certificate with a wrong token, and no certificate at all: refused on every method of
  // both TCP services, before any handler runs.
  auto wrong_token = Auth("n5", "wrong");
  PeerAuthConfig no_cert;
  no_cert.tls_ca_pem = n5_->tls_ca_pem;  // verifies the server, presents nothing
  no_cert.token = n5_->token;
  for (const auto& [label, auth] : std::vector<std::pair<std::string, PeerAuthConfig>>{{"wrong token", *wrong_token}, {"no certificate", no_cert}}) {
    for (const ServiceDescriptor* s : {Service("NodeService"), Service("CoordinatorService")}) {
      Server* srv = s == Service("NodeService") ? c_.nodes_[0].get() : coord_server_;
      grpc::ChannelArguments args;
      args.SetInt("wb.probe.distinct", label.size());
      std::shared_ptr<grpc::Channel> ch;
      if (label == "no certificate") {
        grpc::SslCredentialsOptions o;
        o.pem_root_certs = no_cert.tls_ca_pem;
        ch = grpc::CreateCustomChannel(srv->address(), grpc::SslCredentials(o), args);
      } else {
        ch = MakePeerChannel(srv->address(), auth);
      }
      for (int i = 0; i < s->method_count(); ++i) {
        if (s->method(i)->server_streaming()) continue;
        const std::string method = absl::StrCat("/", s->full_name(), "/", s->method(i)->name());
        const Outcome o = CallGeneric(ch, method, "");
        EXPECT_TRUE(o.code == grpc::StatusCode::UNAUTHENTICATED || o.code == grpc::StatusCode::UNAVAILABLE)
            << label << " " << method << ": " << o.code << " " << o.message;
      }
    }
  }
}

}  // namespace
}  // namespace wb::daemon

namespace wb::daemon {
namespace {

// A plan slice that covers a local rollout in part, installed by the coordinator's certificate (a
// buggy coordinator): refused naming the rollout, piece and tensor. Before, the node took it, a
// version executed and committed from it, and the rollout's Apply made its live weights part old,
// part new while its status said "whole" (the probe's finding). A slice covering every piece is
// taken; m's own versions go on byte for byte.
TEST_F(RpcProbeTest, SliceCoveringALocalRolloutInPartIsRefused) {
  auto stub = pb::NodeService::NewStub(node_channel_);  // the coordinator's certificate
  const std::string worker =
      "workers { worker_id: 'r0' role: ROLE_ROLLOUT node_id: 'n0' gpu: -1 data_address: '127.0.0.1:1' "
      "  layout { buffers { buffer_id: 7 size_bytes: 624 shm_name: '/wb-probe-none' gpu: -1 } "
      "    pieces { tensor: 'a' box { begin: 0 begin: 0 end: 8 end: 16 } buffer_id: 7 strides: 16 strides: 1 } "
      "    pieces { tensor: 'b' box { begin: 0 begin: 0 end: 4 end: 6 } buffer_id: 7 offset_bytes: 512 strides: 6 strides: 1 } } } ";
  const std::string tensors = "tensors { name: 'a' shape: 8 shape: 16 dtype: DTYPE_F32 } tensors { name: 'b' shape: 4 shape: 6 dtype: DTYPE_BF16 } ";
  const std::string op_a = "ops { index: 0 dst_worker: 0 src_piece: 0 dst_piece: 0 tensor: 0 box { begin: 0 begin: 0 end: 8 end: 16 } bytes: 512 } ";
  const std::string op_b = "ops { index: 1 dst_worker: 0 src_piece: 1 dst_piece: 1 tensor: 1 box { begin: 0 begin: 0 end: 4 end: 6 } bytes: 48 } ";
  auto install = [&](const std::string& model, const std::string& ops) {
    pb::InstallPlanRequest req;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        absl::StrCat("slice { model_id: '", model, "' plan_epoch: 1000 mode: MODE_ONE_STEP_OFF ", tensors, worker, ops, " num_buckets: 1 }"), &req));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::InstallPlanResponse resp;
    return stub->InstallPlan(&ctx, req, &resp);
  };
  grpc::Status s = install("m", op_a);  // b of r0 never written
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  for (const char* want : {"rollout r0", "piece 1", "tensor b", "0 of its 24 elements", "part old, part new"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  s = install("m", "ops { index: 0 dst_worker: 0 src_piece: 0 dst_piece: 0 tensor: 0 box { begin: 0 begin: 0 end: 4 end: 16 } bytes: 256 } " + op_b);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "half of a: " << s.error_message();
  EXPECT_NE(s.error_message().find("64 of its 128 elements"), std::string::npos) << s.error_message();
  s = install("pm", op_a + op_b);
  EXPECT_TRUE(s.ok()) << "a slice covering every piece: " << s.error_message();
  pb::ApplyResponse resp;
  for (auto& p : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 2, trainers_, rollouts_)) ASSERT_TRUE(p.ok()) << p.error_message();
  for (TestWorker* r : rollouts_) {
    ASSERT_TRUE(c_.Apply(*r, "m", 2, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// The check itself: every rollout of this node in a version's slice (in a catch-up slice those it
// writes into), each piece in full (several ops may share a piece); remote rollouts are not this
// node's to check.
TEST(SliceCoverageTest, EachWrittenLocalRolloutPieceMustBeCovered) {
  auto slice = [](const std::string& text) {
    pb::PlanSlice s;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &s)) << text;
    return s;
  };
  const std::string workers =
      "model_id: 'm' plan_epoch: 3 "
      "workers { worker_id: 't0' role: ROLE_TRAINER node_id: 'n1' layout { pieces { tensor: 'a' box { begin: 0 end: 10 } } } } "
      "workers { worker_id: 'r0' role: ROLE_ROLLOUT node_id: 'n0' layout { pieces { tensor: 'a' box { begin: 0 end: 10 } } } } "
      "workers { worker_id: 'r1' role: ROLE_ROLLOUT node_id: 'n1' layout { pieces { tensor: 'a' box { begin: 0 end: 10 } } } } ";
  // Two ops fill r0's piece; r1 (remote) gets half from this node's slice: not n0's to check.
  EXPECT_TRUE(CheckSliceCoversLocalRollouts(slice(workers + "ops { src_worker: 0 dst_worker: 1 dst_piece: 0 box { begin: 0 end: 6 } } "
                                                              "ops { src_worker: 0 dst_worker: 1 dst_piece: 0 box { begin: 6 end: 10 } } "
                                                              "ops { src_worker: 1 dst_worker: 2 dst_piece: 0 box { begin: 0 end: 5 } }"),
                                            "n0")
                  .ok());
  // r0 short of elements 6-9.
  absl::Status st = CheckSliceCoversLocalRollouts(slice(workers + "ops { src_worker: 0 dst_worker: 1 dst_piece: 0 box { begin: 0 end: 6 } }"), "n0");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("6 of its 10"), std::string::npos) << st;
  // An op box reaching outside the piece counts only inside it.
  st = CheckSliceCoversLocalRollouts(slice(workers + "ops { src_worker: 0 dst_worker: 1 dst_piece: 0 box { begin: 5 end: 100 } }"), "n0");
  EXPECT_NE(st.message().find("5 of its 10"), std::string::npos) << st;
  // A catch-up slice that writes nothing into r0 (it catches up another rollout) is fine; a
  // version's slice that leaves r0 out is not (r0 would apply staging nobody wrote).
  EXPECT_TRUE(CheckSliceCoversLocalRollouts(slice(workers + "catch_up: true ops { src_worker: 1 dst_worker: 2 dst_piece: 0 box { begin: 0 end: 10 } }"), "n0").ok());
  st = CheckSliceCoversLocalRollouts(slice(workers + "ops { src_worker: 1 dst_worker: 2 dst_piece: 0 box { begin: 0 end: 10 } }"), "n0");
  EXPECT_NE(st.message().find("rollout r0 piece 0 (tensor a) gets 0 of its 10"), std::string::npos) << st;
  // Seen from n1, r1 is local: half of it is refused.
  EXPECT_FALSE(CheckSliceCoversLocalRollouts(slice(workers + "ops { src_worker: 1 dst_worker: 2 dst_piece: 0 box { begin: 0 end: 5 } }"), "n1").ok());
}

// main.cc derives a node's coordinator identity from --coordinator with TargetHost.
TEST(TargetHostTest, HostOfEachTargetForm) {
  EXPECT_EQ(TargetHost("10.0.0.1:7000"), "10.0.0.1");
  EXPECT_EQ(TargetHost("[fd00::1]:7000"), "fd00::1");
  EXPECT_EQ(TargetHost("dns:///coord.example.com:7000"), "coord.example.com");
  EXPECT_EQ(TargetHost("coord"), "coord");
}

}  // namespace
}  // namespace wb::daemon

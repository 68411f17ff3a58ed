#include "transport/testing/peer_interpreter.h"

#include <xxhash.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "transport/testing/peer_process.h"

namespace wb::transport {

std::string ErrLine(const absl::Status& s) {
  std::string msg(s.message());
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  return absl::StrCat("ERR ", static_cast<int>(s.code()), " ", msg);
}

absl::StatusOr<std::unique_ptr<PeerInterpreter>> PeerInterpreter::Create(std::unique_ptr<TestBuffer> buffer,
                                                                         std::unique_ptr<Transport> transport) {
  auto p = std::unique_ptr<PeerInterpreter>(new PeerInterpreter());
  p->buffer_ = std::move(buffer);
  p->transport_ = std::move(transport);
  auto region = p->transport_->RegisterMemory(p->buffer_->spec());
  if (!region.ok()) return region.status();
  p->region_ = *region;
  return p;
}

PeerInterpreter::~PeerInterpreter() {
  if (async_.joinable()) {
    // Its Connect would hold this thread until its deadline: cancelled (the empty round cannot be).
    if (!async_round_.empty()) (void)transport_->CancelRound(async_round_);
    async_.join();
  }
  transport_.reset();
}

std::string PeerInterpreter::AsyncResult(absl::Duration timeout) {
  if (!async_.joinable()) return ErrLine(absl::FailedPreconditionError("no CONNECT_ASYNC running"));
  absl::StatusOr<PeerId> r = absl::UnknownError("");
  {
    absl::MutexLock l(&async_mu_);
    auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(async_mu_) { return async_result_.has_value(); };
    if (!async_mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) return "OK RUNNING";
    r = *async_result_;
    async_result_.reset();
  }
  async_.join();
  return r.ok() ? absl::StrCat("OK ", r->id) : ErrLine(r.status());
}

std::string PeerInterpreter::Execute(const std::string& line, bool* quit) {
  *quit = false;
  Transport& t = *transport_;
  std::vector<std::string> w = absl::StrSplit(line, ' ');
  const std::string& cmd = w[0];
  if (cmd == "ID") return "OK " + t.instance_id();
  if (cmd == "ENDPOINT" && w.size() == 2) {
    auto e = t.ExportEndpoint(w[1]);
    return e.ok() ? "OK " + HexEncode(*e) : ErrLine(e.status());
  }
  if (cmd == "CONNECT" && w.size() == 2) {
    auto bytes = HexDecode(w[1]);
    auto p = bytes.ok() ? t.Connect(*bytes, absl::Now() + absl::Seconds(30)) : bytes.status();
    if (p.ok()) peer_ = *p;
    return p.ok() ? absl::StrCat("OK ", p->id) : ErrLine(p.status());
  }
  if ((cmd == "CONNECT_ROUND" || cmd == "CONNECT_ASYNC") && w.size() == 4) {
    auto bytes = HexDecode(w[1]);
    auto round = HexDecode(w[2]);
    int64_t ms = 0;
    if (!bytes.ok() || !round.ok() || !absl::SimpleAtoi(w[3], &ms)) {
      return ErrLine(absl::InvalidArgumentError(cmd + ": <hex endpoint> <hex round> <ms>"));
    }
    const absl::Time deadline = absl::Now() + absl::Milliseconds(ms);
    if (cmd == "CONNECT_ROUND") {
      auto p = t.Connect(*bytes, *round, deadline);
      if (p.ok()) peer_ = *p;
      return p.ok() ? absl::StrCat("OK ", p->id) : ErrLine(p.status());
    }
    if (async_.joinable()) return ErrLine(absl::FailedPreconditionError("a CONNECT_ASYNC is still running"));
    async_round_ = *round;
    async_ = std::thread([this, endpoint = *bytes, r = *round, deadline] {
      absl::StatusOr<PeerId> p = transport_->Connect(endpoint, r, deadline);
      absl::MutexLock l(&async_mu_);
      async_result_ = std::move(p);
    });
    return "OK";
  }
  if (cmd == "CONNECT_RESULT" && w.size() == 2) {
    int64_t ms = 0;
    (void)absl::SimpleAtoi(w[1], &ms);
    return AsyncResult(absl::Milliseconds(ms));
  }
  if (cmd == "CANCEL_ROUND" && w.size() == 2) {
    auto round = HexDecode(w[1]);
    absl::Status s = round.ok() ? t.CancelRound(*round) : round.status();
    return s.ok() ? "OK" : ErrLine(s);
  }
  if (cmd == "DESC") {
    auto d = t.ExportDescriptor(region_);
    return d.ok() ? "OK " + HexEncode(*d) : ErrLine(d.status());
  }
  if (cmd == "IMPORT" && w.size() == 2) {
    auto bytes = HexDecode(w[1]);
    auto h = bytes.ok() ? t.ImportDescriptor(*bytes) : bytes.status();
    if (h.ok()) test_region_ = *h;
    return h.ok() ? absl::StrCat("OK ", h->id) : ErrLine(h.status());
  }
  if (cmd == "CANCEL_GROUP" && w.size() == 2) {
    uint64_t group = 0;
    (void)absl::SimpleAtoi(w[1], &group);
    absl::Status s = t.CancelBatches(group, "cancelled by the test (CANCEL_GROUP)");
    return s.ok() ? "OK" : ErrLine(s);
  }
  if (cmd == "POST" && (w.size() == 2 || w.size() == 3)) {
    auto bytes = HexDecode(w[1]);
    auto m = bytes.ok() ? DecodeMirror(*bytes) : absl::StatusOr<MirrorBatch>(bytes.status());
    if (!m.ok()) return ErrLine(m.status());
    Batch b;
    b.tag = m->tag;
    b.checksum = m->checksum;
    b.peer = peer_;
    if (w.size() == 3) (void)absl::SimpleAtoi(w[2], &b.group);
    for (auto& o : m->ops) {
      CopyOp op = o.op;
      op.src.region = o.src_is_peer ? region_ : test_region_;
      op.dst.region = o.src_is_peer ? test_region_ : region_;
      b.ops.push_back(std::move(op));
    }
    auto id = t.Post(b);
    return id.ok() ? absl::StrCat("OK ", id->id) : ErrLine(id.status());
  }
  if (cmd == "WAIT" && w.size() == 3) {
    uint64_t id = 0;
    int64_t ms = 0;
    (void)absl::SimpleAtoi(w[1], &id);
    (void)absl::SimpleAtoi(w[2], &ms);
    absl::Status s = t.Wait(BatchId{id}, absl::Now() + absl::Milliseconds(ms));
    return s.ok() ? "OK" : ErrLine(s);
  }
  if ((cmd == "READ" || cmd == "HASH") && w.size() == 3) {
    int64_t off = 0, len = 0;
    (void)absl::SimpleAtoi(w[1], &off);
    (void)absl::SimpleAtoi(w[2], &len);
    std::string out(len > 0 ? len : 0, '\0');
    absl::Status s = buffer_->Read(off, out.data(), len);
    if (!s.ok()) return ErrLine(s);
    return cmd == "READ" ? "OK " + HexEncode(out) : absl::StrCat("OK ", XXH3_64bits(out.data(), out.size()));
  }
  if (cmd == "FILL" && w.size() == 2) {
    uint64_t seed = 0;
    (void)absl::SimpleAtoi(w[1], &seed);
    absl::Status s = buffer_->Fill(seed);
    return s.ok() ? "OK" : ErrLine(s);
  }
  if (cmd == "NAME") return "OK " + buffer_->spec().shared_name;  // so a test that kills us can unlink it
  if (cmd == "QUIT") {
    *quit = true;
    return "";
  }
  return ErrLine(absl::InvalidArgumentError("unknown command " + cmd));
}

}  // namespace wb::transport

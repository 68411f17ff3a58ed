#pragma once
// TEST ONLY. A real child process that is the remote endpoint of a transport in the conformance
// suite (transport_peer_main.cc). Line protocol over its stdin/stdout; every read has a deadline.
//
// Commands (test -> peer), one line each; replies one line "OK <payload>" or "ERR <message>":
//   ID                      -> OK <instance_id>
//   ENDPOINT <peer_inst>    -> OK <hex endpoint bytes for that peer>
//   CONNECT <hex endpoint>  -> OK <peer id>            (blocks up to 30 s inside the peer)
//   CONNECT_ROUND <hex endpoint> <hex round> <ms>      -> OK <peer id> (Connect in that round, deadline ms)
//   CONNECT_ASYNC <hex endpoint> <hex round> <ms>      -> OK  (the same Connect started in the
//                           background: one at a time; its peer id is never used for batches)
//   CONNECT_RESULT <ms>     -> OK RUNNING (still waiting after ms) | OK <peer id> | ERR <code> <message>
//   CANCEL_ROUND <hex round> -> OK | ERR <code> <message>   (Transport::CancelRound)
//   DESC                    -> OK <hex descriptor of the peer's buffer>
//   IMPORT <hex descriptor> -> OK <handle id>
//   POST <hex mirror batch> [group] -> OK <batch id>   (ops in peer terms, see EncodeMirror; Batch::group)
//   CANCEL_GROUP <group>    -> OK | ERR <code> <message>   (Transport::CancelBatches)
//   WAIT <batch id> <ms>    -> OK | ERR <code> <message>
//   READ <offset> <len>     -> OK <hex bytes>
//   FILL <seed>             -> OK
//   HASH <offset> <len>     -> OK <XXH3_64 of those bytes, decimal>
//   NAME                    -> OK <shm name of the buffer, empty for device memory>
//   QUIT                    -> (exits 0)

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wb::transport {

std::string HexEncode(absl::string_view bytes);
absl::StatusOr<std::string> HexDecode(absl::string_view hex);

// An op of a two-sided mirror batch, with each side named by owner: `peer_src` says whether the
// source is the PEER's buffer (true) or the test's imported buffer (false); the other side is the
// other one.
struct MirrorBatch {
  uint64_t tag = 0;
  bool checksum = false;
  struct Op {
    bool src_is_peer = false;
    CopyOp op;  // region handles ignored
  };
  std::vector<Op> ops;
};
std::string EncodeMirror(const MirrorBatch& m);
absl::StatusOr<MirrorBatch> DecodeMirror(absl::string_view bytes);

// "OK <payload>" -> payload; "ERR <code> <message>" -> that status; anything else INTERNAL.
absl::StatusOr<std::string> ParseReplyLine(const std::string& line);

// The remote endpoint of a conformance run, whatever runs it: a child process (PeerProcess) or a
// thread of this process (transport/testing/in_process_peer.h, for in-process fakes).
class PeerHandle {
 public:
  virtual ~PeerHandle() = default;
  // Sends one command line and returns the payload after "OK " or the error after "ERR ".
  virtual absl::StatusOr<std::string> Command(const std::string& line, absl::Duration timeout = absl::Seconds(60)) = 0;
  // Sends without waiting for the reply; collect it with Reply().
  virtual absl::Status Send(const std::string& line) = 0;
  virtual absl::StatusOr<std::string> Reply(absl::Duration timeout = absl::Seconds(60)) = 0;
  // The peer vanishes at once, as kill -9 of its process would make it.
  virtual void Kill9() = 0;
};

class PeerProcess final : public PeerHandle {
 public:
  // Starts `binary` with `args`. The child dies with us (PR_SET_PDEATHSIG) so no orphans remain.
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Spawn(const std::string& binary,
                                                            const std::vector<std::string>& args);
  ~PeerProcess() override;

  absl::StatusOr<std::string> Command(const std::string& line, absl::Duration timeout = absl::Seconds(60)) override;
  absl::Status Send(const std::string& line) override;
  absl::StatusOr<std::string> Reply(absl::Duration timeout = absl::Seconds(60)) override;
  void Kill9() override;
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffered_;
};

}  // namespace wb::transport

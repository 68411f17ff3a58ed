#pragma once
// Pieces shared by the transport implementations (not part of the public interface).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/wire.h"

namespace wb::transport {

// 16 random hex characters.
std::string RandomInstanceId();

// The kernel boot id (same for every process and container of one machine), or the hostname if
// unreadable.
std::string DefaultNodeId();

// Header common to descriptors and endpoints: magic "WBT1", record type, transport kind, owner
// instance, node id. Decode returns INVALID_ARGUMENT with `what` in the message if the bytes are not
// such a record of `expect_kind`.
inline constexpr uint32_t kWireMagic = 0x31544257;  // "WBT1"
enum class RecordType : uint8_t { kEndpoint = 1, kDescriptor = 2 };

// A writer that already holds that header; the backend appends its own fields.
inline wire::Writer RecordWriter(RecordType type, absl::string_view kind, absl::string_view instance,
                                 absl::string_view node) {
  wire::Writer w;
  w.U32(kWireMagic);
  w.U8(static_cast<uint8_t>(type));
  w.Str(kind);
  w.Str(instance);
  w.Str(node);
  return w;
}

// The descriptor of the two-sided transports (host_tcp, nccl): the header, then the exporter's
// region id, the region size and its label. The bytes themselves travel over the peer channel, so
// nothing else is needed to reach them.
struct PlainDescriptor {
  std::string instance;  // the exporter's instance_id()
  std::string node;
  uint64_t region_id = 0;  // the exporter's handle id
  int64_t size = 0;
  std::string label;
};
std::string EncodePlainDescriptor(absl::string_view kind, const PlainDescriptor& d);
// INVALID_ARGUMENT "<kind> ImportDescriptor: ..." when the bytes are not such a descriptor, are
// one of another transport kind, or carry a negative size.
absl::StatusOr<PlainDescriptor> DecodePlainDescriptor(absl::string_view kind, absl::string_view bytes);

}  // namespace wb::transport

#include "transport/common.h"

#include <unistd.h>

#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wb::transport {

std::string RandomInstanceId() {
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  return absl::StrFormat("%016x", v);
}

std::string DefaultNodeId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return std::string(absl::StripAsciiWhitespace(id));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

std::string EncodePlainDescriptor(absl::string_view kind, const PlainDescriptor& d) {
  wire::Writer w = RecordWriter(RecordType::kDescriptor, kind, d.instance, d.node);
  w.U64(d.region_id);
  w.I64(d.size);
  w.Str(d.label);
  return std::move(w.out());
}

absl::StatusOr<PlainDescriptor> DecodePlainDescriptor(absl::string_view kind, absl::string_view bytes) {
  wire::Reader rd(bytes);
  const uint32_t magic = rd.U32();
  const uint8_t type = rd.U8();
  std::string got_kind = rd.Str();
  PlainDescriptor d;
  d.instance = rd.Str();
  d.node = rd.Str();
  d.region_id = rd.U64();
  d.size = rd.I64();
  d.label = rd.Str();
  if (!rd.done() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kDescriptor)) {
    return absl::InvalidArgumentError(absl::StrCat(kind, " ImportDescriptor: bytes are not a transport descriptor"));
  }
  if (got_kind != kind) {
    return absl::InvalidArgumentError(absl::StrCat(kind, " ImportDescriptor: descriptor is for '", got_kind, "'"));
  }
  if (d.size < 0) return absl::InvalidArgumentError(absl::StrCat(kind, " ImportDescriptor: negative size"));
  return d;
}

}  // namespace wb::transport

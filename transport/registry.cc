#include "transport/registry.h"

namespace wb::transport {

absl::Status UnknownRegionError(absl::string_view kind, uint64_t id) {
  return absl::NotFoundError(absl::StrCat(kind, ": unknown region ", id));
}

absl::Status RegionInUseError(absl::string_view kind, const RegionRecord& r) {
  return absl::FailedPreconditionError(
      absl::StrCat(kind, ": region '", r.label, "' is used by ", r.pinned, " unfinished batch(es)"));
}

absl::Status UnknownOpRegionError(absl::string_view batch_prefix, size_t op, const char* which, uint64_t id) {
  return absl::InvalidArgumentError(absl::StrCat(batch_prefix, " op ", op, ": unknown ", which, " region ", id));
}

absl::Status UnknownBatchError(absl::string_view kind, uint64_t id) {
  return absl::NotFoundError(absl::StrCat(kind, ": unknown batch ", id));
}

absl::StatusOr<bool> TwoSidedOpIsSend(const RegionRecord& src, const RegionRecord& dst,
                                      absl::string_view batch_prefix, size_t op, absl::string_view peer_instance) {
  if (src.local == dst.local) {
    return absl::InvalidArgumentError(
        absl::StrCat(batch_prefix, " op ", op, ": needs exactly one local and one imported region"));
  }
  const RegionRecord& remote = src.local ? dst : src;
  if (remote.owner_instance != peer_instance) {
    return absl::InvalidArgumentError(absl::StrCat(batch_prefix, " op ", op, ": region '", remote.label,
                                                   "' was exported by ", remote.owner_instance,
                                                   ", not by the batch's peer ", peer_instance));
  }
  return src.local;
}

RegionInfo BasicRegionInfo(const RegionRecord& r) {
  RegionInfo info;
  info.local = r.local;
  info.size_bytes = r.size;
  info.owner_instance = r.owner_instance;
  info.label = r.label;
  return info;
}

absl::Status CancelledRounds::Check(absl::string_view kind, absl::string_view round) {
  if (round.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        kind, " CancelRound: the empty round names no one attempt (every Connect without a round shares it)"));
  }
  if (round.size() > kMaxConnectRoundBytes) {
    return absl::InvalidArgumentError(absl::StrCat(kind, " CancelRound: a connection round of ", round.size(),
                                                   " bytes (at most ", kMaxConnectRoundBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status CancelledRounds::Error(absl::string_view kind, absl::string_view peer, absl::string_view round) {
  return absl::CancelledError(absl::StrCat(kind, " Connect to peer ", peer, ": its round '", round.substr(0, 64),
                                           "' was cancelled (CancelRound: the caller gave up on this attempt)"));
}

void CancelledRounds::Add(absl::string_view round) {
  const std::string r(round);
  if (auto it = rounds_.find(r); it != rounds_.end()) order_.erase(it->second);
  rounds_[r] = next_;
  order_[next_++] = r;
  while (rounds_.size() > remember_ && !order_.empty()) {
    rounds_.erase(order_.begin()->second);
    order_.erase(order_.begin());
  }
}

void CancelledRounds::Remove(absl::string_view round) {
  auto it = rounds_.find(std::string(round));
  if (it == rounds_.end()) return;
  order_.erase(it->second);
  rounds_.erase(it);
}

}  // namespace wb::transport

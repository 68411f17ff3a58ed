#pragma once
// RETURN_IF_ERROR / ASSIGN_OR_RETURN: the abseil in Debian 12 (20220623) ships neither.
// Usage:
//   RETURN_IF_ERROR(DoThing());
//   ASSIGN_OR_RETURN(auto value, ComputeValue());
//   ASSIGN_OR_RETURN(int n, Parse(s), _.SetPrepend() << ...)  -- not supported: keep it simple;
// use RETURN_IF_ERROR_WITH(expr, "context") to prefix a message instead.

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace wb {

// Returns `status` with `context` prepended to its message (code kept). OK stays OK.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

namespace status_internal {
inline const absl::Status& AsStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace status_internal

}  // namespace wb

#define WB_STATUS_CONCAT_INNER_(a, b) a##b
#define WB_STATUS_CONCAT_(a, b) WB_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                                  \
  do {                                                                         \
    const ::absl::Status wb_status_ = ::wb::status_internal::AsStatus((expr)); \
    if (!wb_status_.ok()) return wb_status_;                                   \
  } while (0)

// Like RETURN_IF_ERROR but prefixes the message with `context` (anything StrCat accepts).
#define RETURN_IF_ERROR_WITH(expr, context)                                    \
  do {                                                                         \
    const ::absl::Status wb_status_ = ::wb::status_internal::AsStatus((expr)); \
    if (!wb_status_.ok()) return ::wb::Annotate(wb_status_, (context));        \
  } while (0)

#define WB_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(*tmp)

#define ASSIGN_OR_RETURN(lhs, expr) \
  WB_ASSIGN_OR_RETURN_IMPL_(WB_STATUS_CONCAT_(wb_statusor_, __LINE__), lhs, expr)

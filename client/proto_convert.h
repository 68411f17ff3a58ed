#pragma once
// The client's names for the one proto <-> planner conversion library, proto/convert.h (whose
// header states the contract). New code: include "proto/convert.h" and call wb::convert::.

#include "proto/convert.h"

namespace wb::client {

namespace pb = ::weightbridge::v1;

using convert::FromProto;
using convert::Mode;
using convert::ModeName;
using convert::ParseMode;
using convert::ParseStrategy;
using convert::PieceFromProto;
using convert::PiecesToProto;
using convert::PieceToProto;
using convert::ToProto;

}  // namespace wb::client

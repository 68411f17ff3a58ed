#pragma once
// Moved to transport/nccl/nccl.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/nccl/nccl.h"  // IWYU pragma: export

#pragma once
// Moved to tests/common/weight_gen.h (issue 14.5); this forwarder goes away at the end of the session.
#include "tests/common/weight_gen.h"  // IWYU pragma: export

#pragma once
// Moved to tests/fake_cuda/fake_cuda.h (issue 14.5); this forwarder goes away at the end of the session.
#include "tests/fake_cuda/fake_cuda.h"  // IWYU pragma: export

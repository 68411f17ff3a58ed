#pragma once
// Moved to transport/cuda_ipc/cuda_vmm.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/cuda_ipc/cuda_vmm.h"  // IWYU pragma: export

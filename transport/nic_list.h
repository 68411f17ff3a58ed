#pragma once
// Moved to transport/host_tcp/nic_list.h (issue 14.5); this forwarder goes away at the end of the session.
#include "transport/host_tcp/nic_list.h"  // IWYU pragma: export

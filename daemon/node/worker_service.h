#pragma once
// WorkerService (the node's Unix socket, called by local workers): RegisterWorker, RegisterLayout,
// Publish, BeginUpdate, Apply, WaitVersion, Deregister, Status, DescribeLayout.
// Defined in worker_service.cc as NodeDaemon::WorkerImpl; NodeDaemon::MakeWorkerService creates it.

#include "daemon/node_daemon.h"

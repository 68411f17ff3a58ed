#pragma once
// NodeService (TCP, called by the coordinator and peer nodes): InstallPlan, ExecuteVersion,
// CommitVersion, AbortVersion, ExchangeRegions, DropWorker, SetupDataChannel, Drain, Status.
// Defined in node_service.cc as NodeDaemon::NodeImpl; NodeDaemon::MakeNodeService creates it.

#include "daemon/node_daemon.h"

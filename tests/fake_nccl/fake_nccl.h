#pragma once
// A CPU emulation of the NCCL API subset WeightBridge calls (the nccl transport and gpu_info), for
// tests on machines without GPUs. It checks our *logic* (communicator setup with deadlines and
// aborts, non-blocking group semantics, per-peer send/recv matching, stream ordering, peer failure)
// across real processes; it says nothing about NCCL's performance or its GPU kernels.
//
// How a binary uses it: compile against the real <nccl.h> (@local_cuda//:nccl, as every NCCL
// source here does), link `//tests/fake_nccl:fake_nccl` and `//tests/fake_cuda:fake_cudart`
// statically (`linkstatic = True`): the nccl* symbols defined in the executable preempt
// libnccl.so's. Device memory and streams are the fake CUDA runtime's (tests/fake_cuda/fake_cuda.h).
//
// Emulated semantics (the contract tests may rely on):
//  - ncclGetUniqueId: magic + 16 random bytes; the bytes name the rendezvous (abstract Unix
//    sockets "wb-fake-nccl/<hex>/<rank>" in this network namespace). Unlike NCCL, whose bootstrap
//    root lives in the process that called ncclGetUniqueId, every rank's communicator listens
//    itself and rank r connects to every rank below it (a full mesh).
//  - ncclCommInitRank[Config]: the current CUDA device is the rank's device. Validates the config
//    (NCCL_CONFIG_INITIALIZER), nranks, rank and the id (ncclInvalidArgument); a rank already
//    taken for this id is ncclInvalidUsage. config.blocking = 0: returns ncclInProgress and
//    ncclCommGetAsyncError reports ncclInProgress until every rank has joined - forever if one
//    never comes (only ncclCommAbort ends that). Blocking: waits (at most the stall limit).
//    Two ranks on the same device of the same host: ncclInvalidUsage on every rank ("Duplicate
//    GPU"), as NCCL refuses it; give each process its own device (WB_FAKE_CUDA_DEVICES=2).
//  - ncclGroupStart/End, ncclSend/ncclRecv: arguments are checked when called (device pointer of
//    the communicator's device with `count` bytes in one live allocation, peer in range, stream of
//    the communicator's device, communicator ready: ncclInvalidArgument / ncclInvalidUsage; an
//    error poisons the group, whose ncclGroupEnd returns it and launches nothing). At ncclGroupEnd
//    sends to self must pair with receives from self in order with equal sizes (ncclInvalidUsage
//    otherwise, as NCCL: "Trying to recv from self without a matching send"). A non-blocking
//    communicator's ncclGroupEnd returns ncclInProgress and the group reaches its stream(s) only
//    WB_FAKE_NCCL_LAUNCH_DELAY_US (default 200) later, after which ncclCommGetAsyncError leaves
//    ncclInProgress: a caller that enqueues on the stream before that sees its work run before
//    the NCCL operations (wrong data). Calls on a communicator whose state is ncclInProgress are
//    ncclInvalidUsage. Blocking communicators enqueue at once.
//  - Execution: a group runs on its stream(s) via wb::fake_cuda::Enqueue, after the
//    communicator's previous groups (NCCL serialises a communicator's operations). Its sends and
//    receives progress concurrently (one poll loop over the peer sockets), so symmetric exchanges
//    of any size cannot deadlock; per peer, the k-th send matches the peer's k-th receive, and the
//    counts must be equal (else ncclInvalidUsage as the async error). Device bytes are reached via
//    wb::fake_cuda::DeviceToHost at run time: memory freed meanwhile is cudaErrorIllegalAddress on
//    the stream and ncclUnhandledCudaError on the communicator.
//  - WB_FAKE_NCCL_ONE_KERNEL_PER_DEVICE=1: a group holds its device (per process) while it moves
//    bytes, like a GPU that does not run two NCCL kernels at once: groups of different
//    communicators on one device run one at a time, and ranks taking their communicators in
//    inconsistent orders deadlock (until ncclCommAbort, or the stall limit: ncclSystemError).
//  - Failures: a peer whose socket closes (process died, or it aborted/destroyed its communicator)
//    makes the async error ncclRemoteError (ncclSystemError for other socket errors); like a real
//    NCCL kernel, the failed group then stays unfinished on its stream until ncclCommAbort. A group
//    whose peer never posts the matching operations also waits until ncclCommAbort.
//  - ncclCommAbort: wakes and ends every wait of the communicator promptly (its stream work
//    finishes without a CUDA error, like aborted NCCL kernels), closes its sockets (the peers see
//    ncclRemoteError when they next need them) and frees the handle. ncclCommDestroy waits for the
//    communicator's launched groups (at most the stall limit) and then does the same.
//  - Every internal wait is bounded: by ncclCommAbort, or by WB_FAKE_NCCL_STALL_LIMIT_S (default
//    120) without progress, after which the async error is ncclSystemError ("no progress") and a
//    stalled group ends with cudaErrorLaunchTimeout. Warnings go to stderr ("fake-nccl WARN").
//  - ncclGetLastError(comm): that communicator's last error, else the process's last error.
//
// Not emulated: collectives, NCCL's buffer registration / windows, split/shrink, performance,
// proxy threads, and the GPU memory model (the emulator copies through host aliases).

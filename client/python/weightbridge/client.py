"""WorkerClient: a trainer or rollout rank talking to its node daemon (WorkerService, Unix socket).

Same verbs and contract as the C++ client (client/worker_client.h):
  [describe_layout: buffer sizes and local tensor places, any time] ->
  register_worker -> create_buffer (POSIX shm, numpy views) / create_cuda_buffer (CUDA IPC) /
  add_cuda_ipc_buffer (existing cudaMalloc memory, e.g. an engine's parameters) /
  add_cuda_vmm_buffer (CUDA VMM memory, e.g. torch expandable segments) -> register_layout
  -> publish (trainer) | begin_update + wait_version, end_update when the wait fails (sync rollout) | apply (one-step-off / async
  rollout) -> deregister; status() any time.
Every call has a deadline (control calls: call_timeout; version calls: the explicit timeout, also
sent to the daemon as timeout_ms). Errors raise WeightBridgeError carrying the daemon's gRPC code.
Reconnect: on UNAVAILABLE the client waits (bounded) for the socket, replays RegisterWorker (with the
client's own token, client_instance: another client of the process registering a worker id this one
holds is refused ALREADY_EXISTS, a replay of this one is not), the fds
of shared VMM allocations and RegisterLayout (same shm names: the segments belong to this process
and survive the daemon) and retries the call once. close() deregisters a worker still registered
(best effort). Buffers are unlinked by close(), or by
free_buffers() after deregister (an engine going to sleep). One thread drives a client at a time.
"""

import dataclasses
import os
import socket
import struct
import time
from typing import List, Optional, Sequence, Tuple

import grpc

from weightbridge._proto import pb, pb_grpc
from weightbridge.discovery import LayoutDescription, describe_request, optional_description
from weightbridge.layouts import DTYPES, ExplicitLayout, InferredLayout, PresetLayout
from weightbridge.shm import SharedBuffer, unique_name

MODES = {"sync": pb.MODE_SYNC, "one_step_off": pb.MODE_ONE_STEP_OFF, "async": pb.MODE_ASYNC}
STRATEGIES = {"weightbridge": pb.STRATEGY_WEIGHTBRIDGE, "rank0_broadcast": pb.STRATEGY_RANK0_BROADCAST,
              "p2p_no_dedup": pb.STRATEGY_P2P_NO_DEDUP}
ROLES = {"trainer": pb.ROLE_TRAINER, "rollout": pb.ROLE_ROLLOUT}
# How long an Apply RPC may outlive its timeout: a copy into live weights that has started runs to the
# node's own limit (2 min, NodeDaemon::Options::live_copy_timeout), as the C++ client allows.
LIVE_COPY_ALLOWANCE_S = 120.0


# gRPC's answer when a daemon's server had no thread for a call (its thread quota, daemon/front.cc):
# the handler never ran, so the call is sent again within its deadline (proto/grpc_retry.h).
SERVER_THREADPOOL_EXHAUSTED = "Server Threadpool Exhausted"
SERVER_BUSY_FIRST_BACKOFF_S = 0.002
SERVER_BUSY_MAX_BACKOFF_S = 0.1


def server_threadpool_exhausted(err):
    """True for gRPC's own thread-pool refusal (not the daemons' RESOURCE_EXHAUSTED limits)."""
    return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (err.details() or "") == SERVER_THREADPOOL_EXHAUSTED


class WeightBridgeError(Exception):
    """A failed call. `code` is the grpc.StatusCode the daemon returned (or DEADLINE_EXCEEDED /
    UNAVAILABLE from the channel), `what` the call."""

    def __init__(self, what, code, message):
        super().__init__("%s: %s: %s" % (what, code.name, message))
        self.what = what
        self.code = code
        self.message = message


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters (ModelSpec.lora): with it the model's tensors are these adapters alone, in PEFT
    names, laid out by the presets peft / peft_fsdp2 (trainers) and vllm_lora (rollouts);
    docs/presets.md "LoRA adapters"."""
    target_modules: Sequence[str]  # PEFT names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    r: int
    alpha: float
    max_lora_rank: int = 0  # vllm_lora: vLLM --max-lora-rank (0 = its default 16, or the smallest it accepts >= r)
    fully_sharded_loras: bool = False  # vllm_lora: vLLM --fully-sharded-loras

    def to_proto(self):
        return pb.LoraSpec(target_modules=list(self.target_modules), r=self.r, alpha=self.alpha,
                           max_lora_rank=self.max_lora_rank, fully_sharded_loras=self.fully_sharded_loras)


@dataclasses.dataclass
class ModelConfig:
    """The model a worker joins; the first worker creates it, later ones must match exactly."""
    model_id: str
    hf_config_json: Optional[str] = None  # text of an HF config.json, or:
    explicit_tensors: Optional[Sequence[Tuple[str, Sequence[int]]]] = None  # [(name, shape)]
    dtype: str = "bfloat16"
    num_trainer_workers: int = 0
    num_rollout_workers: int = 0
    mode: str = "sync"  # sync | one_step_off | async
    max_staleness: int = 0
    strategy: str = "weightbridge"
    lora: Optional[LoraConfig] = None  # with hf_config_json: a model of these LoRA adapters alone

    def to_proto(self):
        if (self.hf_config_json is None) == (self.explicit_tensors is None):
            raise ValueError("model %s: give exactly one of hf_config_json, explicit_tensors" % self.model_id)
        if self.mode not in MODES:
            raise ValueError("model %s: mode %r not in %s" % (self.model_id, self.mode, list(MODES)))
        if self.strategy not in STRATEGIES:
            raise ValueError("model %s: strategy %r not in %s" % (self.model_id, self.strategy, list(STRATEGIES)))
        code = DTYPES[self.dtype][0]
        spec = pb.ModelSpec(model_id=self.model_id, dtype=code, num_trainer_workers=self.num_trainer_workers,
                            num_rollout_workers=self.num_rollout_workers, mode=MODES[self.mode],
                            max_staleness=self.max_staleness, strategy=STRATEGIES[self.strategy])
        if self.lora is not None:
            if self.hf_config_json is None:
                raise ValueError("model %s: lora needs hf_config_json" % self.model_id)
            spec.lora.CopyFrom(self.lora.to_proto())
        if self.hf_config_json is not None:
            spec.hf_config_json = self.hf_config_json
        else:
            spec.explicit_tensors.CopyFrom(pb.ExplicitInventory(tensors=[
                pb.TensorSpec(name=n, shape=list(s), dtype=code) for n, s in self.explicit_tensors]))
        return spec


@dataclasses.dataclass
class PublishResult:
    version: int
    stall_seconds: float


@dataclasses.dataclass
class ApplyResult:
    applied_version: int
    stall_seconds: float


@dataclasses.dataclass
class EndUpdateResult:
    applied_version: int    # the version the worker's live weights hold (0: none yet)
    committed_version: int  # the newest version committed for the worker on its node


@dataclasses.dataclass
class LayoutInfo:
    num_pieces: int
    bytes: int   # canonical bytes the pieces cover (what one version moves in), not the buffers' sizes
    source: str  # "pieces" | "preset" | "index_probe" | "client_extracted"
    # Where every local tensor lives (discovery.LayoutDescription; None from an older daemon).
    layout: Optional[LayoutDescription] = None


def _ms(seconds):
    return max(1, int(seconds * 1000))


# ---- the node daemon's fd channel (<worker socket>.fd; protocol: base/fd_passing.h) ----
_FD_OFFER_MAGIC = 0x44464257  # "WBFD"
_FD_REPLY_MAGIC = 0x52464257  # "WBFR"
_MAX_VMM_KEY_BYTES = 128
_CODES = {c.value[0]: c for c in grpc.StatusCode}  # absl and gRPC share the numbering


def _wire_str(b):
    return struct.pack("<I", len(b)) + b


def offer_vmm_fd(channel_path, model_id, worker_id, key, allocation_bytes, fd, timeout=30.0, allocation_id=0):
    """Hands CUDA VMM allocation `fd` (cuMemExportToShareableHandle, POSIX fd; it stays the
    caller's) to the node daemon's fd channel under (`worker_id`, `key`), with the allocation's
    size. The daemon takes it only from the process it binds to `worker_id` (the one that
    registered it); its refusal raises WeightBridgeError with the daemon's code and message, a
    channel nobody listens on UNAVAILABLE, a missed deadline DEADLINE_EXCEEDED.
    `allocation_id` (> 0; unique in this process, the same on every offer of one allocation: a
    VmmRange's) lets the daemon tell a replay of the allocation from another one offered under a
    key it saw before (it maps that one anew); 0 sends none (as before the field)."""
    what = "offer of CUDA VMM allocation '%s' of worker %s" % (key, worker_id)
    payload = (struct.pack("<I", _FD_OFFER_MAGIC) + _wire_str(model_id.encode()) + _wire_str(worker_id.encode())
               + _wire_str(key.encode()) + struct.pack("<q", int(allocation_bytes)))
    if allocation_id:
        payload += struct.pack("<Q", int(allocation_id))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(max(0.001, timeout))
        try:
            sock.connect(channel_path)
        except OSError as e:
            raise WeightBridgeError(what, grpc.StatusCode.UNAVAILABLE,
                                    "fd channel: connect %s: %s (is the node daemon running, with a CUDA-capable build?)"
                                    % (channel_path, e.strerror or e)) from None
        try:
            socket.send_fds(sock, [payload], [fd])
            reply = sock.recv(8192)
        except socket.timeout:
            raise WeightBridgeError(what, grpc.StatusCode.DEADLINE_EXCEEDED, "fd channel: no answer in %.1f s" % timeout) from None
        except OSError as e:
            raise WeightBridgeError(what, grpc.StatusCode.UNAVAILABLE, "fd channel: %s" % e) from None
    finally:
        sock.close()
    if len(reply) < 12:
        raise WeightBridgeError(what, grpc.StatusCode.INTERNAL, "fd channel: malformed reply from the daemon")
    magic, code, n = struct.unpack_from("<III", reply)
    if magic != _FD_REPLY_MAGIC or len(reply) != 12 + n or code not in _CODES:
        raise WeightBridgeError(what, grpc.StatusCode.INTERNAL, "fd channel: malformed reply from the daemon")
    if code != 0:
        raise WeightBridgeError(what, _CODES[code], reply[12:].decode(errors="replace"))


def _device_range(what, ptr, size_bytes, gpu):
    """(pointer, bytes, gpu) of a device range given as an int pointer or a torch tensor (whose
    size and GPU are then the defaults). ValueError naming `what` for a range of no bytes."""
    if hasattr(ptr, "data_ptr"):  # a torch tensor
        tensor = ptr
        ptr = tensor.data_ptr()
        if size_bytes is None:
            size_bytes = tensor.nelement() * tensor.element_size()
        if gpu is None:
            gpu = tensor.device.index
    ptr, size_bytes = int(ptr), int(size_bytes or 0)
    if size_bytes <= 0:
        raise ValueError("%s: size_bytes must be > 0, got %d" % (what, size_bytes))
    return ptr, size_bytes, gpu


class WorkerClient:
    def __init__(self, socket_path, call_timeout=30.0, connect_timeout=10.0, reconnect=True,
                 reconnect_timeout=30.0, shm_prefix="py", populate_buffers=False):
        self.socket_path = socket_path[len("unix:"):] if socket_path.startswith("unix:") else socket_path
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self.reconnect = reconnect
        self.reconnect_timeout = reconnect_timeout
        self.shm_prefix = shm_prefix
        self.populate_buffers = populate_buffers
        self.reconnects = 0
        self.server_busy_retries = 0  # calls sent again because the daemon had no thread for them
        self.buffers: List = []
        self.model_id = None
        self.worker_id = None
        self._register_req = None
        self._layout_req = None
        # Sync rollout: end_update was called after the last begin_update (the engine reads its
        # weights). A restarted daemon counts the rollout as paused, so _replay ends it again.
        self._resumed = False
        self._vmm = {}  # key -> (our fd of the allocation, its bytes, cuda.VmmRange)
        self._channel = None
        self._stub = None
        # This client's random token (RegisterWorkerRequest.client_instance), sent with every send of
        # its registration (replays too): the daemon refuses another client of this process that
        # registers a worker id this one holds (ALREADY_EXISTS), and takes this one's replays as such.
        self.client_instance = os.urandom(16).hex()
        self._open(time.monotonic() + connect_timeout)

    # ------------------------------------------------------------------ channel
    def _open(self, deadline):
        if self._channel is not None:
            self._channel.close()
        # Layout descriptions of big models are large (FSDP2 over Kimi-K2: ~70k local tensors, tens
        # of MB); gRPC's default 4 MB receive limit would refuse them.
        self._channel = grpc.insecure_channel("unix:" + self.socket_path,
                                              options=[("grpc.max_receive_message_length", 256 << 20),
                                                       ("grpc.max_send_message_length", 256 << 20)])
        self._stub = pb_grpc.WorkerServiceStub(self._channel)
        # Whether the connection dropped after it was up: gRPC would silently reconnect on the next
        # call, maybe to a restarted daemon that forgot this worker (as the C++ client checks).
        self._dropped = False
        channel, was_ready = self._channel, [False]

        def watch(state):
            if state == grpc.ChannelConnectivity.READY:
                was_ready[0] = True
            elif was_ready[0] and channel is self._channel:
                self._dropped = True
        self._channel.subscribe(watch, try_to_connect=False)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=max(0.001, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise WeightBridgeError("connect", grpc.StatusCode.UNAVAILABLE,
                                    "daemon socket %s did not accept a connection in time" % self.socket_path)

    def _call(self, what, method, request, timeout, retry=True, extra=0.0):
        """`extra`: seconds the RPC may outlive `timeout` (Apply: a live copy that started runs to the
        node's own copy limit and is not cut by the client's deadline; docs/daemon.md "Live weights")."""
        deadline = time.monotonic() + timeout
        if retry and self.reconnect and self._register_req is not None and self._dropped:
            # Reconnect explicitly and replay first (RegisterWorker, VMM fds, RegisterLayout).
            self._replay(time.monotonic() + max(0.001, min(self.reconnect_timeout, timeout)))
        try:
            return self._send(method, request, deadline, timeout + 2.0 + extra)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE and retry and self.reconnect:
                left = min(self.reconnect_timeout, deadline - time.monotonic())
                if left > 0:
                    self._replay(time.monotonic() + left)
                    return self._call(what, method, request, max(0.001, deadline - time.monotonic()), retry=False,
                                      extra=extra)
            raise WeightBridgeError(what, code, e.details() or "") from None

    def _send(self, method, request, deadline, rpc_timeout):
        """One RPC, sent again (2 ms backoff, doubling to 100 ms) while the daemon's gRPC server had no
        thread for it (RESOURCE_EXHAUSTED "Server Threadpool Exhausted": its handler never ran) and the
        next try starts before `deadline`; as the C++ clients do (proto/grpc_retry.h)."""
        backoff = SERVER_BUSY_FIRST_BACKOFF_S
        start = time.monotonic()
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=max(0.001, rpc_timeout - (time.monotonic() - start)))
            except grpc.RpcError as e:
                if not server_threadpool_exhausted(e) or time.monotonic() + backoff >= deadline:
                    raise
                self.server_busy_retries += 1
            # A backoff before sending again, not a poll: gRPC offers nothing to wait on for a free
            # server thread; bounded by `deadline` above.
            time.sleep(backoff)
            backoff = min(backoff * 2, SERVER_BUSY_MAX_BACKOFF_S)

    def _replay(self, deadline):
        self._open(deadline)
        for what, method, req in (("RegisterWorker", "RegisterWorker", self._register_req),
                                  ("RegisterLayout", "RegisterLayout", self._layout_req)):
            if req is None:
                continue
            # A daemon that did not restart answers the same request (this client's token in it) OK,
            # changing nothing. ALREADY_EXISTS means another client of this process holds the worker
            # id now: replaying the layout would take its place, so the replay fails.
            try:
                getattr(self._stub, method)(req, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                raise WeightBridgeError("replay " + what, e.code(), e.details() or "") from None
            if method == "RegisterWorker":  # a restarted daemon has none of our VMM fds
                self._offer_vmm_all(deadline)
        if self._resumed and self._register_req is not None:
            try:
                left = max(0.001, deadline - time.monotonic())
                self._stub.EndUpdate(self._end_update_request(left), timeout=left)
            except grpc.RpcError as e:
                raise WeightBridgeError("replay EndUpdate", e.code(), e.details() or "") from None
        self.reconnects += 1

    def _offer_vmm(self, key, deadline):
        fd, size, alloc = self._vmm[key]
        offer_vmm_fd(self.socket_path + ".fd", self.model_id, self.worker_id, key, size, fd,
                     timeout=max(0.001, deadline - time.monotonic()), allocation_id=alloc.allocation_id)

    def _offer_vmm_all(self, deadline):
        for key in self._vmm:
            self._offer_vmm(key, deadline)

    # ------------------------------------------------------------------ verbs
    def register_worker(self, model: ModelConfig, worker_id: str, role: str, gpu: int = -1):
        if self._register_req is not None:
            raise WeightBridgeError("RegisterWorker", grpc.StatusCode.FAILED_PRECONDITION,
                                    "already registered as %s" % self.worker_id)
        req = pb.RegisterWorkerRequest(model_id=model.model_id, worker_id=worker_id, role=ROLES[role], gpu=gpu,
                                       model=model.to_proto(), client_instance=self.client_instance)
        resp = self._call("RegisterWorker %s" % worker_id, "RegisterWorker", req, self.call_timeout)
        self._register_req = req
        self.model_id, self.worker_id = model.model_id, worker_id
        # Allocations shared before a deregister: the daemon takes them only from the process it
        # binds to this worker now, so hand them over again.
        self._offer_vmm_all(time.monotonic() + self.call_timeout)
        return resp.session

    def create_buffer(self, size_bytes) -> SharedBuffer:
        """A new zero-filled shm buffer (id = creation index); sent by the next register_layout."""
        b = SharedBuffer(unique_name(self.shm_prefix), size_bytes, len(self.buffers), self.populate_buffers)
        self.buffers.append(b)
        return b

    def create_cuda_buffer(self, size_bytes, gpu):
        """Device memory exported by CUDA IPC (see weightbridge.cuda; needs a GPU)."""
        from weightbridge.cuda import CudaBuffer
        b = CudaBuffer(size_bytes, gpu, len(self.buffers))
        self.buffers.append(b)
        return b

    def add_cuda_ipc_buffer(self, ptr, size_bytes=None, gpu=None):
        """A buffer over EXISTING cudaMalloc device memory this client did not allocate (e.g. an
        engine's parameters from torch's caching allocator), shared by CUDA IPC. `ptr` is a device
        pointer (int) or a torch tensor (size_bytes and gpu then default to the tensor's). The
        allocation holding [ptr, ptr + size_bytes) is found (cuMemGetAddressRange) and the buffer
        is that WHOLE allocation, exported by the IPC handle of its base (legacy IPC maps an
        allocation from its base; a tensor inside is addressed by layout offsets from it:
        `buffer.base`, as torch's CUDA IPC sends handle + offset). One buffer per allocation: a
        pointer into an allocation that already has one returns that buffer (same id). ValueError
        when the range is not inside one cudaMalloc allocation (CUDA VMM memory:
        add_cuda_vmm_buffer), or `gpu` is not the GPU holding it. The memory stays its owner's:
        close() / free_buffers() only forget it; it must stay allocated while registered."""
        from weightbridge import cuda
        ptr, size_bytes, gpu = _device_range("add_cuda_ipc_buffer", ptr, size_bytes, gpu)
        alloc = cuda.device_allocation_of(ptr)
        if alloc.vmm:
            raise ValueError("add_cuda_ipc_buffer: 0x%x is CUDA VMM memory (cuMemCreate), which CUDA IPC cannot export: "
                             "add_cuda_vmm_buffer" % ptr)
        if ptr + size_bytes > alloc.base + alloc.size:
            raise ValueError("add_cuda_ipc_buffer: %d bytes at 0x%x run past the end of their cudaMalloc allocation "
                             "[0x%x, +%d)" % (size_bytes, ptr, alloc.base, alloc.size))
        if gpu is not None and int(gpu) != alloc.gpu:
            raise ValueError("add_cuda_ipc_buffer: 0x%x lives on GPU %d, not GPU %d" % (ptr, alloc.gpu, int(gpu)))
        for b in self.buffers:
            if isinstance(b, cuda.IpcBuffer) and b.ptr == alloc.base and b.size_bytes == alloc.size:
                return b
        b = cuda.IpcBuffer(alloc, len(self.buffers))
        self.buffers.append(b)
        return b

    def add_cuda_vmm_buffer(self, ptr, size_bytes=None, gpu=None):
        """A buffer in CUDA VMM memory (cuMemCreate), which CUDA IPC handles cannot export: a torch
        tensor allocated with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a range of a
        weightbridge.cuda.VmmAllocation. `ptr` is a device pointer (int) or a torch tensor (then
        size_bytes and gpu default to the tensor's). The allocation that holds `ptr` is found
        (cuMemGetAddressRange / cuMemRetainAllocationHandle), and its POSIX fd is sent to the daemon
        over its fd channel the first time (one fd per allocation, however many buffers lie in it);
        the buffer itself is sent by the next register_layout as [offset, + size_bytes) of that
        allocation. Needs register_worker first (the daemon takes fds only from the registered
        worker's process). The range may cross several allocations mapped back to back (torch's
        expandable segments map a segment from one 2 MiB / 20 MiB allocation per page, so a big
        tensor spans several): every allocation under [ptr, ptr + size_bytes) is found
        (cuda.vmm_allocations_of), each shared once, and the buffer names them in order; the
        daemon maps them as one range. ValueError when a byte of the range is not mapped VMM
        memory or the allocations sit on two GPUs. The memory must stay allocated while
        registered; the client holds a reference to each allocation until close(). ValueError as
        well for an allocation created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (vLLM's
        sleep-mode allocator): no fd of it can be exported.
        Daemon refusals raise WeightBridgeError with the daemon's code and message."""
        from weightbridge import cuda
        if self._register_req is None:
            raise WeightBridgeError("add_cuda_vmm_buffer", grpc.StatusCode.FAILED_PRECONDITION,
                                    "register_worker first (the daemon takes fds only from registered workers)")
        ptr, size_bytes, gpu = _device_range("add_cuda_vmm_buffer", ptr, size_bytes, gpu)
        try:
            allocs = cuda.vmm_allocations_of(ptr, size_bytes, exportable=True)
        except ValueError as e:
            raise ValueError("add_cuda_vmm_buffer: %s" % e) from None
        shared_now = []
        try:
            deadline = time.monotonic() + self.call_timeout
            for alloc in allocs:
                if alloc.key in self._vmm:
                    continue
                if len(alloc.key) > _MAX_VMM_KEY_BYTES:
                    raise ValueError("VMM key too long: %s" % alloc.key)
                fd = alloc.export_fd()
                self._vmm[alloc.key] = (fd, alloc.size, alloc)
                shared_now.append(alloc.key)
                self._offer_vmm(alloc.key, deadline)
        except BaseException:
            # Nothing of this buffer stays shared here (the daemon may keep an fd it took: unused).
            for key in shared_now:
                os.close(self._vmm.pop(key)[0])
            raise
        finally:
            for alloc in allocs:
                if self._vmm.get(alloc.key, (None, None, None))[2] is not alloc:
                    alloc.close()  # a reference is already held (shared earlier), or nothing was shared
        first = allocs[0]
        gpu = first.gpu if gpu is None else int(gpu)
        b = cuda.VmmBuffer(len(self.buffers), ptr, size_bytes, gpu, cuda.gpu_uuid(gpu), first.key, ptr - first.base,
                           [a.key for a in allocs[1:]])
        self.buffers.append(b)
        return b

    def _buffer_specs(self):
        out = []
        for b in self.buffers:
            if hasattr(b, "vmm_key"):
                out.append(pb.BufferSpec(buffer_id=b.id, size_bytes=b.size_bytes, cuda_vmm_key=b.vmm_key,
                                         cuda_vmm_offset=b.vmm_offset, gpu=b.gpu, gpu_uuid=b.gpu_uuid,
                                         cuda_vmm_next_keys=b.vmm_next_keys))
            elif isinstance(b, SharedBuffer):
                out.append(pb.BufferSpec(buffer_id=b.id, size_bytes=b.size_bytes, shm_name=b.name, gpu=-1))
            else:
                out.append(pb.BufferSpec(buffer_id=b.id, size_bytes=b.size_bytes, cuda_ipc_handle=b.ipc_handle, gpu=b.gpu,
                                          gpu_uuid=getattr(b, "gpu_uuid", b"")))
        return out

    def register_layout(self, layout, weight_buffer=None, resolve="auto") -> LayoutInfo:
        """Sends every buffer so far and `layout` (PresetLayout, ExplicitLayout or InferredLayout).

        InferredLayout: `weight_buffer` holds the local tensors at the layout's offsets. resolve=
        "daemon" sends an IndexProbe (a probe buffer is created for it and kept, so a reconnect can
        replay the layout) and the node daemon's extractor recovers the pieces (every case
        planner/index_probe.h handles: transposes, interleaves, flat shards included); "client"
        extracts pieces here (layouts.extract_pieces: row/column splits, fused rows, padding only;
        no probe buffer, so 4x less memory than the probe of a bf16 model); "auto" (default) uses
        the daemon and falls back to the client only when the daemon answers UNIMPLEMENTED (a
        build without the extractor). LayoutInfo.source says which one ran.
        """
        if self._register_req is None:
            raise WeightBridgeError("RegisterLayout", grpc.StatusCode.FAILED_PRECONDITION, "register_worker first")
        if isinstance(layout, InferredLayout):
            if weight_buffer is None:
                raise ValueError("register_layout(InferredLayout) needs weight_buffer=")
            if weight_buffer.size_bytes < layout.buffer_bytes:
                raise ValueError("weight buffer of %d bytes < the layout's %d" % (weight_buffer.size_bytes, layout.buffer_bytes))
            if resolve in ("daemon", "auto"):
                probe_buf = self.create_buffer(max(8, layout.probe_bytes()))
                spec = layout.to_index_probe(weight_buffer.id, probe_buf.id,
                                             probe_buf.array("int64", (probe_buf.size_bytes // 8,)))
                try:
                    return self._send_layout(spec, "index_probe")
                except WeightBridgeError as e:
                    if resolve == "daemon" or e.code != grpc.StatusCode.UNIMPLEMENTED:
                        raise
            spec = layout.to_explicit(weight_buffer.id).to_proto()
            return self._send_layout(spec, "client_extracted")
        if isinstance(layout, PresetLayout):
            return self._send_layout(layout.to_proto(), "preset")
        if isinstance(layout, ExplicitLayout):
            return self._send_layout(layout.to_proto(), "pieces")
        raise TypeError("unknown layout type %s" % type(layout).__name__)

    def _send_layout(self, spec, source):
        req = pb.RegisterLayoutRequest(model_id=self.model_id, worker_id=self.worker_id,
                                       buffers=self._buffer_specs(), layout=spec)
        resp = self._call("RegisterLayout of %s" % self.worker_id, "RegisterLayout", req, self.call_timeout)
        self._layout_req = req
        return LayoutInfo(resp.num_pieces, resp.bytes, source, optional_description(resp))

    def describe_layout(self, layout, model: Optional["ModelConfig"] = None) -> LayoutDescription:
        """Layout discovery: the buffer sizes and every local tensor's place for `layout`
        (PresetLayout or ExplicitLayout), computed by the node daemon without registering anything
        (discovery.LayoutDescription: .buffer_bytes(id), [name], .view / .views over the buffers,
        .device_pointer for CUDA buffers). Before register_worker pass `model` (its spec travels
        with the request); after it, the registered model is described. Errors raise
        WeightBridgeError with the daemon's code (INVALID_ARGUMENT: the preset does not fit the
        model; NOT_FOUND: the node does not know the model and no `model` was given)."""
        if isinstance(layout, InferredLayout):
            raise TypeError("an inferred layout is resolved from its probe: register_layout describes it (LayoutInfo.layout)")
        if not isinstance(layout, (PresetLayout, ExplicitLayout)):
            raise TypeError("unknown layout type %s" % type(layout).__name__)
        if self._register_req is not None:
            req = describe_request(self.model_id, self.worker_id, layout.to_proto(), role=self._register_req.role)
        elif model is not None:
            req = describe_request(model.model_id, "", layout.to_proto(), model.to_proto())
        else:
            raise WeightBridgeError("DescribeLayout", grpc.StatusCode.FAILED_PRECONDITION,
                                    "before register_worker, pass model= (its spec goes with the request)")
        resp = self._call("DescribeLayout for model %s" % req.model_id, "DescribeLayout", req, self.call_timeout)
        return LayoutDescription.from_proto(resp.layout)

    def model_tensors(self, model: Optional["ModelConfig"] = None):
        """The model's tensors as the daemon's inventory holds them (HF names, whole shapes, the
        canonical dtype), in inventory order: {name: discovery.LocalTensor}. What a trainer or tool
        needs to build or check whole tensors (a ZeRO-3 or FSDP2 rank holds only its part). The
        daemon computes it from the model's HF config - the description of the `fsdp` preset at
        dp=1, one rank holding every tensor whole -; nothing is registered. `model` as in
        describe_layout (needed before register_worker)."""
        if self._register_req is not None:
            req = describe_request(self.model_id, "", PresetLayout("fsdp", dp=1, rank=0).to_proto(), role=pb.ROLE_TRAINER)
        elif model is not None:
            req = describe_request(model.model_id, "", PresetLayout("fsdp", dp=1, rank=0).to_proto(), model.to_proto(),
                                   role=pb.ROLE_TRAINER)
        else:
            raise WeightBridgeError("DescribeLayout", grpc.StatusCode.FAILED_PRECONDITION,
                                    "before register_worker, pass model= (its spec goes with the request)")
        resp = self._call("DescribeLayout (model tensors) for model %s" % req.model_id, "DescribeLayout", req, self.call_timeout)
        return dict(LayoutDescription.from_proto(resp.layout).tensors)

    def publish(self, version, timeout=60.0) -> PublishResult:
        """Trainer: `version` is ready in the buffers; they must not change until this returns.

        CUDA buffers: every write of the version must have completed on the device first (e.g.
        torch.cuda.synchronize()): the daemon reads them from another process."""
        resp = self._call("Publish v%d by %s" % (version, self.worker_id), "Publish",
                          pb.PublishRequest(model_id=self.model_id, worker_id=self.worker_id, version=version,
                                            timeout_ms=_ms(timeout)), timeout)
        return PublishResult(resp.version, resp.stall_seconds)

    def begin_update(self, timeout=60.0):
        """Rollout, sync mode: paused; live weights may be overwritten by the next version. A version
        committed while it had resumed (end_update) is copied into them before this returns."""
        self._resumed = False  # paused from here on (the node marks it first)
        resp = self._call("BeginUpdate of %s" % self.worker_id, "BeginUpdate",
                          pb.BeginUpdateRequest(model_id=self.model_id, worker_id=self.worker_id,
                                                timeout_ms=_ms(timeout)), timeout)
        return resp.committed_version

    def end_update(self, timeout=60.0) -> EndUpdateResult:
        """Rollout, sync mode: the engine resumed generating (e.g. its wait_version timed out or
        failed). From now on no commit writes the live weights: a version committed meanwhile
        becomes the worker's committed copy, which the next begin_update (or wait_version) copies
        into them before answering. A copy into them that is running is waited for, up to
        `timeout`; DEADLINE_EXCEEDED when it still runs (call again before reading the weights).
        Returns EndUpdateResult(applied_version = what the live weights hold, committed_version).
        Other modes: no effect. Sent again after a reconnect to a restarted daemon (until the next
        begin_update), which would otherwise count the rollout as paused."""
        self._resumed = True  # replayed after a reconnect, also when this call fails
        resp = self._call("EndUpdate of %s" % self.worker_id, "EndUpdate", self._end_update_request(timeout), timeout)
        return EndUpdateResult(resp.applied_version, resp.committed_version)

    def _end_update_request(self, timeout):
        return pb.EndUpdateRequest(model_id=self.model_id, worker_id=self.worker_id, timeout_ms=_ms(timeout))

    def apply(self, version=0, timeout=60.0) -> ApplyResult:
        """Rollout, one-step-off / async: make `version` live now. 0 = the newest committed version,
        without waiting (applied_version 0: nothing committed yet); v > 0 waits up to `timeout`
        until a version >= v is committed, then makes the newest committed one live
        (applied_version may be > v)."""
        resp = self._call("Apply v%d by %s" % (version, self.worker_id), "Apply",
                          pb.ApplyRequest(model_id=self.model_id, worker_id=self.worker_id, version=version,
                                          timeout_ms=_ms(timeout)), timeout, extra=LIVE_COPY_ALLOWANCE_S)
        return ApplyResult(resp.applied_version, resp.stall_seconds)

    def wait_version(self, version, timeout=60.0):
        resp = self._call("WaitVersion v%d of %s" % (version, self.model_id), "WaitVersion",
                          pb.WaitVersionRequest(model_id=self.model_id, version=version, timeout_ms=_ms(timeout),
                                                worker_id=self.worker_id),
                          timeout)
        return resp.committed_version

    def deregister(self):
        self._call("Deregister %s" % self.worker_id, "Deregister",
                   pb.DeregisterRequest(model_id=self.model_id, worker_id=self.worker_id), self.call_timeout)
        self._register_req = self._layout_req = None
        self._resumed = False

    def status(self, model_id="", node_id=""):
        """The daemon's StatusResponse. model_id / node_id: StatusRequest's filter, applied by the
        coordinator before its status byte budget (only that model's status, versions and workers;
        only that node and its workers); an id it does not know raises NOT_FOUND."""
        return self._call("Status", "Status", pb.StatusRequest(model_id=model_id, node_id=node_id), self.call_timeout)

    def free_buffers(self):
        """After deregister(): closes every buffer this client made (shm segments unlinked, CUDA
        buffers cudaFree'd) and drops its VMM fds and allocation references (VMM memory is the
        caller's: its own free then releases it), so that an engine going to sleep (vLLM sleep
        mode, SGLang release_memory_occupation) really gives the memory back - it cannot while
        the daemon maps it (the daemon's CUDA IPC mapping keeps freed device memory alive, its shm
        mapping the segment). Buffer ids start at 0 again: a later register_worker +
        create_*buffer + register_layout sends only the new buffers. FAILED_PRECONDITION while
        registered. The channel stays open (close() closes it)."""
        if self._register_req is not None:
            raise WeightBridgeError("free_buffers", grpc.StatusCode.FAILED_PRECONDITION,
                                    "worker %s of model %s is registered and the daemon maps its buffers: deregister first"
                                    % (self.worker_id, self.model_id))
        self._close_buffers()

    def _close_buffers(self):
        for b in self.buffers:
            b.close()
        self.buffers = []
        for fd, _, alloc in self._vmm.values():
            os.close(fd)
            alloc.close()
        self._vmm = {}

    def close(self):
        """Deregisters a worker still registered (best effort, one call of at most 5 s: a daemon that is
        gone forgets it anyway), unlinks the buffers and closes the channel. Without the deregister the
        node kept the worker registered to this client's unlinked memory, and another client of this
        process could not take the worker id (ALREADY_EXISTS: its token differs)."""
        if self._register_req is not None and self._stub is not None:
            try:
                self._stub.Deregister(pb.DeregisterRequest(model_id=self.model_id, worker_id=self.worker_id),
                                      timeout=min(5.0, self.call_timeout))
            except grpc.RpcError:
                pass  # a daemon that is gone forgot the worker; close goes on either way
            self._register_req = self._layout_req = None
        self._close_buffers()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""The rollout side shared by the vLLM and SGLang integrations."""

from weightbridge.integrations._common import LayoutHook
from weightbridge.layouts import PresetLayout


class RolloutHook(LayoutHook):
    """One engine rank (tp rank of a dp rank of a replica) as a rollout worker.

    Host memory: versions land in the shm buffer; `update()` (sync) / `apply()` (one-step-off,
    async) then copy it into the engine's parameters (`params`: dict(model.named_parameters())).
    memory="cuda": versions land in the registered CUDA buffer and `update()` / `apply()` copy
    them into the parameters in place, device to device (the addresses CUDA graphs captured stay
    valid; the weights are held twice on the GPU). `bind(params)` once after loading instead
    re-points the parameters into the buffer (no copy, no second copy of the weights) - only for
    an engine without CUDA graphs captured over its parameters (LayoutHook.bind).
    memory="engine" (zero copy; `params` at construction): the engine's own parameter memory is
    registered (LayoutHook._register_engine) and versions land in the parameters themselves -
    no copy, no second copy of the weights, and the parameters' addresses never change, so CUDA
    graphs captured over them stay valid. update() / apply() copy nothing.

    Engines that sleep between rollouts (colocated RL: vLLM `sleep` / `wake_up`, SGLang
    `release_memory_occupation` / `resume_memory_occupation`): the engine's sleep does not free
    this buffer (we allocated it, outside the engine's allocator), so call `release()` after the
    engine slept and `reacquire(params)` after it woke (its weights), before the trainers publish
    the next version; docs/integration.md "Engines that sleep"."""

    def __init__(self, engine, socket_path, model, tp=1, tp_rank=0, dp=1, dp_rank=0, replica=0, replicas=1,
                 expert_parallel=False, expert_placement="", moe_a2a_backend="", quantization="", worker_id=None, memory="host", gpu=-1,
                 client=None, enable_dp_lm_head=False, moe_dense_tp_size=0, params=None):
        rank = (replica * dp + dp_rank) * tp + tp_rank
        preset = PresetLayout(engine, tp=tp, dp=dp, replicas=replicas, rank=rank, expert_parallel=expert_parallel,
                              expert_placement=expert_placement, moe_a2a_backend=moe_a2a_backend, quantization=quantization,
                              enable_dp_lm_head=enable_dp_lm_head, moe_dense_tp_size=moe_dense_tp_size)
        super().__init__(socket_path, model, worker_id or "rollout/%d" % rank, "rollout", preset, memory, gpu, client,
                         shm_prefix=engine, params=params)

    def update(self, version, params=None, timeout=300.0, end_update_timeout=None):
        """Sync mode: the engine has paused generation; returns once `version` is committed into
        the buffer (and, host memory, copied into `params`).

        When begin_update or the wait fails (timed out, aborted, ...) the engine is about to resume with the
        weights it has: end_update() is called before the error is re-raised, so that no later
        commit writes the buffer while the engine reads it (memory="cuda": the parameters ARE the
        buffer); the next update() pauses again and copies what was committed meanwhile.
        `end_update_timeout` (default `timeout`) bounds its wait for a copy into the buffer that
        is already running. If end_update itself fails, that error is raised (chained to the
        wait's): the buffer may still be written, so the engine must not resume on it."""
        self._holding("update(%d)" % version)
        try:
            # (A failed begin_update too: the node marks the rollout paused before it asks the
            # coordinator, and the engine resumes when this raises.)
            self.client.begin_update(timeout)
            got = self.client.wait_version(version, timeout)
        except Exception as wait_error:
            self.client.end_update(timeout if end_update_timeout is None else end_update_timeout)
            raise wait_error
        self._landed(params)
        return got

    def apply(self, version=0, params=None, timeout=300.0):
        """One-step-off / async, at a step boundary: makes `version` (0 = newest committed) live."""
        self._holding("apply(%d)" % version)
        got = self.client.apply(version, timeout).applied_version
        self._landed(params)
        return got

    def release(self, timeout=300.0):
        """The engine went to sleep: this rank leaves the daemon and frees its buffer, so the memory
        goes back (the daemon's mapping would keep it alive; WorkerClient.free_buffers). Sync mode:
        end_update(timeout) first, which waits for a commit that is writing the buffer (DEADLINE_
        EXCEEDED: still writing; nothing was released, call again). Then deregister and free.

        memory="cuda", bound: the parameters now point at freed device memory until reacquire()
        re-binds them: the engine must not run (generate, capture or replay CUDA graphs) in
        between; not bound: the parameters are the engine's own memory, as for host memory.
        memory="host": the shm buffer is freed the same way; the engine's parameters are its own
        memory (what its sleep does to them is the engine's business).
        memory="engine": the daemon lets go of the engine's memory (its IPC / VMM mappings go with
        the deregistration) and the client forgets the buffers and drops its VMM references;
        nothing is freed here - the engine's sleep frees (or keeps) its own memory.
        RuntimeError when already released."""
        self._holding("release")
        if self.model.mode == "sync":
            self.client.end_update(timeout)
        self.client.deregister()
        self.buffer = None  # released from here on, whatever free_buffers does
        self._np_views, self._torch_views = {}, None  # host: the shm mapping goes with its last view
        self.client.free_buffers()

    def reacquire(self, params=None):
        """The engine woke up (its weights at least): registers this rank again - same worker id,
        role, gpu and preset - with a new, empty buffer of the discovered size. Bound before (bind)
        and `params` given: the parameters are bound into it WITHOUT copying their current bytes
        (they point at the buffer release() freed), so they hold zeros until the next update /
        apply. Otherwise `params` is not used; the next update / apply copies the version into
        them.

        The rank holds no version now. update(v) / apply(v) wait as usual: the daemon catches it up
        to the committed version from another rollout that holds it (docs/daemon.md "Catch-up"),
        or, when none does (every engine slept), it gets the next version the trainers publish - so
        trainers should publish after the engines woke. RuntimeError when not released.

        memory="engine": the parameters (`params`, else those given at construction) are
        registered again from their addresses now - after vLLM's wake_up the same virtual
        addresses, possibly over new physical memory (VMM: each allocation is offered anew), so
        the daemon counts the rank as holding no version, as above."""
        if self.buffer is not None:
            raise RuntimeError("reacquire: worker %s of model %s holds its buffer (not released): reacquire follows release()"
                               % (self.worker_id, self.model.model_id))
        if self.memory == "engine" and params is not None:
            from weightbridge.integrations._common import engine_params
            self.engine_params = engine_params(params)
        self._register()
        if self.bound and params is not None:
            self.bind(params, copy_current=False)

    def _landed(self, params):
        """A version is in the buffer. Host memory, or CUDA memory not bound: copied into `params`
        in place (none given: the engine's weights did not change; CUDA: device to device, so the
        addresses CUDA graphs captured stay valid). Bound CUDA memory, or memory="engine": the
        parameters are the buffer. Then whatever the engine derived from its weights is refreshed."""
        if not self.bound and self.memory != "engine":
            if params is None:
                return
            self.read_into(params)
        self.refresh_derived()

    def refresh_derived(self):
        """Called once the engine's parameters hold a new version: engines that derive copies from
        their weights at load time recompute them here (SglangRollout). Nothing by default."""

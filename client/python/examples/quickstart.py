#!/usr/bin/python3
"""WeightBridge quickstart: the whole RL weight-sync loop, on host memory, against a real daemon.

Everything a trainer and an inference engine do to move policy weights after each training step,
in one script you can run (numpy only, no torch, no GPU):

  1. a node daemon: a standalone `weightbridged` on a temporary Unix socket (or yours: --socket);
  2. the model: its Hugging Face config.json, how many trainer and rollout ranks, the mode;
  3. two trainer ranks laid out as Megatron-Core with tensor parallelism 2, and one or two
     rollout replicas laid out as vLLM (tp 1 by default): each rank asks the daemon where its
     tensors live (layout discovery), allocates a shared-memory buffer of that size, registers;
  4. per version (training step): each trainer rank copies its local tensors into its buffer and
     publishes; each rollout receives the version - sync: begin_update + wait_version; one-step-off
     / async: apply - and reads its tensors out of its buffer;
  5. each rollout checks every byte it received against what it must hold; per-version timings
     and byte counts are printed, and any mismatch makes the script exit 1.

Run (from the repository root):

    bazel build //daemon:weightbridged //proto:weightbridge_proto_py
    /usr/bin/python3 client/python/examples/quickstart.py                  # sync, 3 versions
    /usr/bin/python3 client/python/examples/quickstart.py --mode one_step_off --versions 5 --replicas 1
    /usr/bin/python3 client/python/examples/quickstart.py --socket /run/wb/w.sock   # a daemon already running

(Debian's python3 with python3-grpcio, python3-protobuf and python3-numpy, as the client needs.)

Options: --help. Exit status: 0 every byte verified, 1 a byte mismatched, 2 anything else went
wrong (daemon, timeout, bad option); the daemon's log is printed then. The real trainer / engine
hooks (weightbridge.integrations: Megatron, FSDP2, vLLM, SGLang; the other files in this folder)
do steps 3-4 for you from named_parameters(); this script shows what they do, with the plain client.

The weights are synthetic but exact: element i of HF tensor t at version v is a fixed hash of
(t, v, i) (weightbridge.weights: the generator of tests/common/weight_gen.h), so the trainer can
write and each rollout can check its shard without a reference copy of the other side.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
try:
    import grpc
    import numpy as np
except ImportError as e:
    print("quickstart: %s: the client needs grpcio, protobuf and numpy (Debian: apt-get install python3-grpcio "
          "python3-protobuf python3-numpy, then run it with /usr/bin/python3)" % e, file=sys.stderr)
    sys.exit(2)
try:
    import weightbridge as wb
except ImportError:  # run from a source checkout without PYTHONPATH: use the client next to this file
    sys.path.insert(0, os.path.dirname(HERE))
    import weightbridge as wb


from weightbridge import weights

DEFAULT_CONFIG = os.path.join(REPO, "tests", "e2e", "testdata", "qwen2.5-0.5b-2layer.json")
OK, MISMATCH, ERROR = 0, 1, 2
# numpy has no bfloat16: the views show each element's bits as an unsigned int of its size.
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ------------------------------------------------------------------------------------------------
# Step 1: a node daemon. In a cluster every node runs `weightbridged --role=node` and one
# coordinator runs `--role=coordinator`; a standalone daemon is both, for one machine.
# ------------------------------------------------------------------------------------------------
def find_daemon(given):
    built = os.path.join(REPO, "bazel-bin", "daemon", "weightbridged")
    for cand in ([given] if given else [os.environ.get("WB_DAEMON"), built]):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError("no weightbridged binary at %s: build it with `bazel build //daemon:weightbridged`"
                            % (given or "$WB_DAEMON or " + built))


class StandaloneDaemon:
    """`weightbridged --role=standalone` on a fresh Unix socket and a free TCP port; stop() ends it."""

    def __init__(self, binary, workdir):
        self.socket = os.path.join(workdir, "w.sock")
        self.log_path = os.path.join(workdir, "daemon.log")
        self._log = open(self.log_path, "w")
        argv = [binary, "--role=standalone", "--worker_socket=" + self.socket, "--listen=127.0.0.1:0",
                "--port_file=" + os.path.join(workdir, "port")]
        # Its own session: a Ctrl-C in the terminal reaches this script, which shuts the workers
        # down first and then the daemon (stop), instead of both at once.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout):
        """Returns once the daemon accepts connections on its socket; RuntimeError when it exits
        first, TimeoutError after `timeout`. Waits on both events, no polling."""
        ready = threading.Event()
        channel = grpc.insecure_channel("unix:" + self.socket)
        try:
            grpc.channel_ready_future(channel).add_done_callback(lambda _: ready.set())
            threading.Thread(target=lambda: (self.proc.wait(), ready.set()), daemon=True).start()
            ready.wait(timeout)
        finally:
            channel.close()
        if self.proc.poll() is not None:
            raise RuntimeError("weightbridged exited with status %d at start" % self.proc.returncode)
        if not ready.is_set():
            raise TimeoutError("weightbridged did not accept connections on %s in %.0f s" % (self.socket, timeout))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def log_tail(self, n=3000):
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""


# ------------------------------------------------------------------------------------------------
# The "training step": the model's Hugging Face tensors at version v (a stand-in for your
# optimizer's output). Only bits matter to WeightBridge; they are never interpreted as numbers.
# ------------------------------------------------------------------------------------------------
def hf_tensor_shapes(client, model):
    """{HF tensor name: (shape, element bytes)} of the model, as the daemon lists them. The daemon
    parsed the config: describing the layout of a rank that holds the whole model (FSDP2 with one
    rank) lists every tensor, whole, without registering anything."""
    desc = client.describe_layout(wb.PresetLayout("fsdp", dp=1, rank=0), model=model)
    out = {}
    for place in desc.tensors.values():
        for i in place.pieces:
            p = desc.pieces[i]
            if any(p.box.begin):
                raise RuntimeError("fsdp dp=1 describes %s from %s, not whole" % (p.tensor, list(p.box.begin)))
            out[p.tensor] = (tuple(p.box.end), np.dtype(place.numpy_dtype()).itemsize)
    return out


def hf_state_dict(shapes, version):
    """{HF name: array of element bits} at `version`: element i of the t-th tensor is
    weights.weight_values(t, version, i) - made in chunks to keep the temporaries small."""
    out = {}
    for t, (name, (shape, size)) in enumerate(shapes.items()):
        n = int(np.prod(shape)) if shape else 1
        flat = np.empty(n, dtype=BITS[size])
        for s in range(0, n, 1 << 21):
            e = min(n, s + (1 << 21))
            flat[s:e] = weights.weight_values(t, version, np.arange(s, e, dtype=np.uint64), size)
        out[name] = flat.reshape(shape)
    return out


# ------------------------------------------------------------------------------------------------
# Layout discovery: a local tensor (what the framework calls e.g. "...linear_qkv.weight") holds one
# or more pieces, each a box of an HF tensor at a byte offset, with strides. Your framework already
# holds its local tensors; this script builds them from the pieces, and checks them the same way.
# ------------------------------------------------------------------------------------------------
def piece_region(local, place, piece):
    """The elements of `local` (an array of local tensor `place`: its view in the buffer, or a
    contiguous array of its shape) that hold canonical box `piece.box`, as a strided view."""
    item = local.dtype.itemsize
    if place.buffer_id != piece.buffer_id or (piece.offset_bytes - place.offset_bytes) % item:
        raise ValueError("piece of %s does not lie inside local tensor %s" % (piece.tensor, place.name))
    if piece.quant_dtype:
        raise NotImplementedError("local tensor %s holds a quantised piece: this script moves unquantised weights"
                                  % place.name)
    if not local.flags.c_contiguous:
        raise ValueError("local tensor %s is not row-major" % place.name)
    first = (piece.offset_bytes - place.offset_bytes) // item
    shape = [e - b for b, e in zip(piece.box.begin, piece.box.end)]
    last = first + sum((d - 1) * s for d, s in zip(shape, piece.strides))
    if first < 0 or last >= local.size:
        raise ValueError("piece of %s reaches outside local tensor %s" % (piece.tensor, place.name))
    flat = local.reshape(-1)[first:]
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=[s * item for s in piece.strides], writeable=True)


def box_of(state_dict, piece):
    return state_dict[piece.tensor][tuple(slice(b, e) for b, e in zip(piece.box.begin, piece.box.end))]


def framework_tensors(desc, state_dict):
    """(local name, array) of every local tensor of a trainer rank: what Megatron's
    model.named_parameters() would give that rank. Built here from the HF tensors and the pieces."""
    for name, place in desc.tensors.items():
        if not place.pieces:
            continue
        local = np.zeros(place.shape, dtype=BITS[np.dtype(place.numpy_dtype()).itemsize])
        for i in place.pieces:
            piece_region(local, place, desc.pieces[i])[...] = box_of(state_dict, desc.pieces[i])
        yield name, local


# ------------------------------------------------------------------------------------------------
# Steps 2-3: the ranks. Each is one WorkerClient (in a real job: one per trainer / engine process).
# ------------------------------------------------------------------------------------------------
class Rank:
    """One worker: describe its layout, register, allocate the buffer the daemon asked for,
    register the layout, and keep numpy views of its local tensors."""

    def __init__(self, socket, model, worker_id, role, layout, timeout):
        self.worker_id, self.role, self.layout = worker_id, role, layout
        self.client = wb.WorkerClient(socket, call_timeout=timeout, connect_timeout=timeout,
                                      shm_prefix="qs" + role[0])
        # (a) Layout discovery, before anything is registered: the buffer size and, per local
        #     tensor, its name, shape, dtype, offset and strides - computed by the daemon from
        #     the HF config and the preset. Nothing in your code computes an offset.
        self.desc = self.client.describe_layout(layout, model=model)
        # (b) Join the model (the first worker creates it; later ones must give the same spec).
        self.client.register_worker(model, worker_id, role)
        # (c) A POSIX shared-memory buffer of the size discovery gave (mode 0600, this process's).
        self.buffer = self.client.create_buffer(self.desc.buffer_bytes(0))
        # (d) Say what the buffer holds: the preset by name; the daemon resolves and validates it.
        self.info = self.client.register_layout(layout)
        # (e) {local tensor name: numpy view over the buffer}: writes go straight into shared memory.
        self.views = {n: v.view(BITS[v.dtype.itemsize]) for n, v in self.desc.views(self.client.buffers).items()}
        self.live = 0  # rollouts: the version the buffer holds (0: none yet)

    def close(self):
        try:
            self.client.deregister()  # leave the model
        finally:
            self.client.close()  # unlinks the shm buffer


def run_parallel(calls, timeout):
    """Runs each (label, fn) in its own thread, as the ranks of a real job run in their own
    processes; returns {label: result}. Raises the first error, or TimeoutError naming the calls
    still running after `timeout` (each call carries its own, shorter deadline)."""
    results, errors, threads = {}, [], []

    def run(label, fn):
        try:
            results[label] = fn()
        except BaseException as e:  # reported by the caller's thread
            errors.append((label, e))
    for label, fn in calls:
        threads.append((label, threading.Thread(target=run, args=(label, fn), daemon=True)))
        threads[-1][1].start()
    deadline = time.monotonic() + timeout
    for _, th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stuck = [label for label, th in threads if th.is_alive()]
    if errors:
        label, e = errors[0]
        raise RuntimeError("%s failed: %s" % (label, e)) from e
    if stuck:
        raise TimeoutError("still running after %.0f s: %s" % (timeout, ", ".join(stuck)))
    return results


# ------------------------------------------------------------------------------------------------
# Step 4: one version.
# ------------------------------------------------------------------------------------------------
def publish(rank, local_tensors, version, timeout):
    """A trainer rank after its optimizer step: copy every local tensor into its view, publish."""
    t0 = time.monotonic()
    for name, param in local_tensors:
        rank.views[name][...] = param  # torch: desc.torch_views(client.buffers)[name].copy_(param)
    copied = time.monotonic() - t0
    # Publish: the buffer holds `version`. sync: returns once every rollout holds it (the trainer
    # waits); one-step-off / async: returns once the daemon snapshotted the buffer (the trainer's
    # only stall) and the transfer goes on while training continues.
    res = rank.client.publish(version, timeout=timeout)
    return {"copy_s": copied, "stall_s": res.stall_seconds}


def receive_sync(rank, version, timeout):
    """A sync rollout, generation paused since begin_update (called before the trainers
    published): wait until `version` is committed into its buffer."""
    t0 = time.monotonic()
    try:
        got = rank.client.wait_version(version, timeout=timeout)
    except wb.WeightBridgeError:
        # The engine is about to resume with the weights it has: say so, so that no later commit
        # writes the buffer under it (docs/integration.md "Sync rollouts whose wait fails").
        rank.client.end_update(timeout=timeout)
        raise
    return {"version": got, "stall_s": time.monotonic() - t0}


def receive_apply(rank, version, mode, timeout):
    """A one-step-off / async rollout at its step boundary: make a committed version live.
    one-step-off asks for exactly `version`; async for anything newer than what it holds (a
    newer committed version supersedes an older one it never applied)."""
    want = version if mode == "one_step_off" else rank.live + 1
    res = rank.client.apply(want, timeout=timeout)
    return {"version": res.applied_version, "stall_s": res.stall_seconds}


def verify(rank, state_dict, version):
    """Every element the rollout's layout receives, read through its views, against version
    `version` of the HF tensors. Returns (bytes checked, [mismatch descriptions])."""
    checked, bad = 0, []
    for name, place in rank.desc.tensors.items():
        view = rank.views[name]  # what the engine copies into its parameter of that name
        for i in place.pieces:
            piece = rank.desc.pieces[i]
            got, want = piece_region(view, place, piece), box_of(state_dict, piece)
            diff = got != want
            checked += got.size * got.dtype.itemsize
            if diff.any():
                at = tuple(int(x) for x in np.argwhere(diff)[0])
                hf_at = tuple(b + a for b, a in zip(piece.box.begin, at))
                bad.append("%s: local tensor %s, %s box %s..%s: %d of %d elements differ, first at %s: got 0x%x, want 0x%x"
                           % (rank.worker_id, name, piece.tensor, list(piece.box.begin), list(piece.box.end),
                              int(diff.sum()), diff.size, hf_at, int(got[at]), int(want[at])))
    return checked, bad


def flip_one_bit(rank):
    """--flip_one_bit: damages one received element (the middle of the last piece), as a bug in
    the transfer would; the check must catch it."""
    name, place = [(n, p) for n, p in rank.desc.tensors.items() if p.pieces][-1]
    region = piece_region(rank.views[name], place, rank.desc.pieces[place.pieces[-1]])
    at = np.unravel_index(region.size // 2, region.shape)
    region[at] ^= 1
    return "%s: flipped bit 0 of %s%s" % (rank.worker_id, name, list(int(x) for x in at))


def version_status(client, model_id, version):
    """The daemon's record of a version: state, bytes moved, seconds, end-to-end digests."""
    for vs in client.status(model_id=model_id).versions:
        if vs.model_id == model_id and vs.version == version:
            return vs
    return None


HEADER = "ver  update_s  trainer_stall  copy_in_s  rollout_stall  state       MiB_moved  daemon_s  digests  MiB_checked  check"
ROW = "%3d  %8.3f  %13.3f  %9.3f  %13.3f  %-10s  %9.1f  %8.3f  %-7s  %11.1f  %s"
LEGEND = """  update_s: from the trainers' copy into their buffers until every rollout holds the version
  trainer_stall: Publish (sync: until every rollout holds it; else until the daemon snapshotted the buffer)
  copy_in_s: the trainers' copy of their local tensors into the buffer
  rollout_stall: sync: wait_version; one-step-off / async: apply (it waits for the transfer when asked at once)
  state, MiB_moved, daemon_s, digests: the daemon's record of the version (status(model_id=...).versions);
    digests: every transfer op's bytes were hashed where they were read and where they landed, and matched
  MiB_checked, check: what the rollouts checked, element by element, against the version's HF tensors"""


def mib(n):
    return n / float(1 << 20)


def run(args, socket):
    with open(args.config) as f:
        config_json = f.read()
    # Step 2: the model. Every worker of it gives the same ModelConfig; the first creates it.
    trainers_n, rollouts_n = 2, args.replicas * args.rollout_tp
    model = wb.ModelConfig(model_id=args.model_id, hf_config_json=config_json, num_trainer_workers=trainers_n,
                           num_rollout_workers=rollouts_n, mode=args.mode)
    ranks = []
    try:
        # Step 3: the ranks. Trainers: Megatron-Core tensor parallel ranks 0 and 1 (fused
        # linear_qkv per query group, vocab-parallel embedding, ... as Megatron holds them).
        # Rollouts: vLLM ranks (fused qkv_proj = [q; k; v], gate_up_proj, ...), one tp group per
        # replica; rank = replica * tp + tp_rank. The daemon plans how the bytes go from one
        # layout to the other once every expected worker registered.
        trainers = [Rank(socket, model, "trainer/%d" % r, "trainer", wb.PresetLayout("megatron", tp=2, rank=r),
                         args.timeout) for r in range(trainers_n)]
        ranks += trainers
        rollouts = [Rank(socket, model, "rollout/%d" % r, "rollout",
                         wb.PresetLayout("vllm", tp=args.rollout_tp, replicas=args.replicas, rank=r), args.timeout)
                    for r in range(rollouts_n)]
        ranks += rollouts
        for k in trainers + rollouts:
            example = [t for t in k.desc.tensors.values() if len(t.pieces) > 1][:1] or list(k.desc.tensors.values())[:1]
            print("%-10s %-8s buffer %7.1f MiB, %3d local tensors holding %7.1f MiB of HF tensors; e.g. %s %s = %d pieces"
                  % (k.worker_id, k.layout.preset, mib(k.buffer.size_bytes), len(k.desc.tensors), mib(k.info.bytes),
                     example[0].name, list(example[0].shape), len(example[0].pieces)))
        shapes = hf_tensor_shapes(trainers[0].client, model)
        print("model %s: %d HF tensors, %.1f MiB per version; mode %s, %d versions"
              % (args.model_id, len(shapes), mib(sum(int(np.prod(s)) * b for s, b in shapes.values())), args.mode,
                 args.versions))

        total_checked = total_expected = 0
        failures = []
        join = args.timeout + 30  # each call has its own deadline; this only bounds the threads
        print(HEADER)
        for v in range(1, args.versions + 1):
            # The training step (not timed): the HF tensors of version v, and each trainer rank's
            # local tensors - what its model.named_parameters() holds after optimizer.step().
            state_dict = hf_state_dict(shapes, v)
            local = {k.worker_id: list(framework_tensors(k.desc, state_dict)) for k in trainers}
            t0 = time.monotonic()
            calls = [(k.worker_id, lambda k=k, t=local[k.worker_id]: publish(k, t, v, args.timeout)) for k in trainers]
            if args.mode == "sync":
                # Sync: each rollout pauses generation and says so first; the version starts once
                # every rollout did, and the commit writes their buffers. Then all wait together.
                for k in rollouts:
                    k.client.begin_update(timeout=args.timeout)
                calls += [(k.worker_id, lambda k=k: receive_sync(k, v, args.timeout)) for k in rollouts]
                results = run_parallel(calls, join)
            else:
                # One-step-off / async: the trainers publish and go on training; each engine applies
                # the version at its next step boundary (here: right away).
                results = run_parallel(calls, join)
                results.update(run_parallel([(k.worker_id, lambda k=k: receive_apply(k, v, args.mode, args.timeout))
                                             for k in rollouts], join))
            update_s = time.monotonic() - t0
            del local
            for k in rollouts:
                k.live = results[k.worker_id]["version"]
                if k.live != v:  # nothing newer was published: each rollout must hold exactly v
                    raise RuntimeError("%s holds version %d after receiving version %d" % (k.worker_id, k.live, v))
            if args.flip_one_bit and v == args.versions:
                print("  --flip_one_bit:", flip_one_bit(rollouts[0]))
            # Step 5: every rollout checks every byte its layout received (an engine would now copy
            # its views into its parameters: param.copy_(views[name])).
            checked_v, bad_v = 0, []
            for k in rollouts:
                checked, bad = verify(k, state_dict, v)
                checked_v += checked
                total_expected += k.desc.piece_bytes
                bad_v += ["v%d %s" % (v, b) for b in bad]
            total_checked += checked_v
            failures += bad_v
            del state_dict
            vs = version_status(trainers[0].client, args.model_id, v)
            print(ROW % (v, update_s, max(results[k.worker_id]["stall_s"] for k in trainers),
                         max(results[k.worker_id]["copy_s"] for k in trainers),
                         max(results[k.worker_id]["stall_s"] for k in rollouts),
                         vs.state if vs else "?", mib(vs.bytes_total) if vs else 0.0, vs.seconds if vs else 0.0,
                         ("yes" if vs.verified else "no") if vs else "?", mib(checked_v), "MISMATCH" if bad_v else "ok"))
        print(LEGEND)

        if failures:
            for f in failures[:20]:
                print("  " + f)
            print("quickstart: FAILED - %d mismatching pieces (mode %s); %d of %d bytes checked"
                  % (len(failures), args.mode, total_checked, total_expected))
            return MISMATCH
        if total_checked != total_expected or total_checked == 0:
            print("quickstart: FAILED - checked %d bytes, the rollouts' layouts receive %d" % (total_checked, total_expected))
            return MISMATCH
        print("quickstart: OK - every byte verified: %d versions x %d rollouts, %d of %d bytes (mode %s)"
              % (args.versions, len(rollouts), total_checked, total_expected, args.mode))
        return OK
    finally:
        # Leave the model and free the shared memory (also after an error or Ctrl-C).
        for k in reversed(ranks):
            try:
                k.close()
            except Exception as e:  # the daemon may be gone already; the buffer is unlinked anyway
                print("quickstart: closing %s: %s" % (k.worker_id, e), file=sys.stderr)


def _interrupt(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="sync", choices=["sync", "one_step_off", "async"])
    ap.add_argument("--versions", type=int, default=3, help="training steps to publish (default 3)")
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="a Hugging Face config.json (default: a 2-layer Qwen2.5-0.5B)")
    ap.add_argument("--replicas", type=int, default=2, choices=[1, 2, 3, 4], help="vLLM rollout replicas (default 2)")
    ap.add_argument("--rollout_tp", type=int, default=1, help="tensor parallel size of each rollout replica (default 1)")
    ap.add_argument("--socket", help="use the node daemon listening on this worker socket instead of starting one")
    ap.add_argument("--daemon_bin", help="weightbridged to start (default: $WB_DAEMON, else bazel-bin/daemon/weightbridged)")
    ap.add_argument("--model_id", default="quickstart-%d" % os.getpid())
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take (default 120)")
    ap.add_argument("--flip_one_bit", action="store_true",
                    help="damage one received element of the last version before it is checked: the run must fail")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they happen, also through a pipe
    if args.versions < 1 or args.rollout_tp < 1 or args.timeout <= 0:
        ap.error("--versions and --rollout_tp must be >= 1, --timeout > 0")
    if not os.path.isfile(args.config):
        ap.error("--config %s: no such file" % args.config)

    # Ctrl-C raises KeyboardInterrupt; make SIGTERM do the same so that the cleanup below runs.
    signal.signal(signal.SIGTERM, _interrupt)
    daemon, workdir = None, None
    try:
        try:
            if args.socket:
                socket = args.socket
            else:
                workdir = tempfile.mkdtemp(prefix="wb-quickstart.")
                daemon = StandaloneDaemon(find_daemon(args.daemon_bin), workdir)
                socket = daemon.socket
                print("daemon: %s, pid %d, socket %s, log %s" % (daemon.proc.args[0], daemon.proc.pid, socket, daemon.log_path))
                daemon.wait_ready(args.timeout)
            return run(args, socket)
        except (wb.WeightBridgeError, RuntimeError, TimeoutError, ValueError, OSError) as e:
            print("quickstart: error: %s" % e, file=sys.stderr)
            if daemon is not None:
                state = "running" if daemon.proc.poll() is None else "exited with %s" % daemon.proc.returncode
                print("--- daemon (%s), end of its log:\n%s" % (state, daemon.log_tail()), file=sys.stderr)
            return ERROR
        except KeyboardInterrupt:
            print("quickstart: interrupted; cleaning up", file=sys.stderr)
            return 130
    finally:
        if daemon is not None:
            daemon.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)  # socket, port file, daemon log


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Black-box chaos driver for WeightBridge (real processes on loopback): a coordinator and node
daemons from bazel-bin (CHAOS_BIN overrides), trainer_worker / rollout_worker processes, kill -9 of
nodes, the coordinator, rollouts and both trainers at random moments; every applied version is
checked byte for byte by the workers. A manual tool (not run by `make test`): the permanent,
bounded versions are //tests/soak:soak_test and //tests/soak:chaos_delta_test (docs/soak.md).
Build first: bazel build //daemon:weightbridged //tests/e2e:trainer_worker //tests/e2e:rollout_worker //client:wbctl
Extra daemon flags: CHAOS_FLAGS="--log_level=debug ...".
Waits: the driver watches files other processes write (port files, JSON progress lines in logs);
the standard library has no inotify, so each wait polls every 20-50 ms up to its deadline. The
only fixed pauses are the faults' own random delays and two settle periods (before the fd
baseline, and a second look before reporting maps of dead workers' memory).

usage: chaos.py MODE ROUNDS SEED [--model tiny|mid|2layer] [--quant fp8_block128|mxfp8] [--kinds a,b]
       [--delta_cache_mb N --delta_fraction F --delta_threads T --delta_in_place true|false]
       [--digests true|false] [--rollout_nodes N --bucket_kb K --nic_GBps G] [--lora q_proj,v_proj --lora_r 8]
       [--rollout_tp N]
--quant takes any rollout scheme the e2e workers know (fp8_block128, mxfp8, nvfp4, w4a16_g32).
--rollout_tp N: each rollout node holds one engine of N ranks (N processes; rollout kills take one rank).
chaos2: extended for issue 17 (deltas, sender-side quantisation, digests, relays, LoRA-only versions).
"""
import argparse, ctypes, json, os, random, re, signal, subprocess, sys, tempfile, time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN = os.environ.get("CHAOS_BIN", os.path.join(REPO, "bazel-bin"))
DAEMON = BIN + "/daemon/weightbridged"
TRAINER = BIN + "/tests/e2e/trainer_worker"
ROLLOUT = BIN + "/tests/e2e/rollout_worker"
MODELS = {"tiny": os.path.join(REPO, "tests/soak/testdata/qwen2-tiny.json"),
          "mid": os.path.join(os.path.dirname(os.path.abspath(__file__)), "mid.json"),
          "2layer": os.path.join(REPO, "tests/e2e/testdata/qwen2.5-0.5b-2layer.json")}
libc = ctypes.CDLL("libc.so.6", use_errno=True)


def pdeath():
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setsid()


class Proc:
    def __init__(self, d, name, argv):
        self.name, self.argv = name, argv
        self.log = os.path.join(d, name + ".log")
        f = open(self.log, "ab")
        self.p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, preexec_fn=pdeath)
        f.close()
        self.pid = self.p.pid
        self.off = 0
        self.events = []

    def poll_events(self):
        with open(self.log, "rb") as f:
            f.seek(self.off)
            data = f.read()
        nl = data.rfind(b"\n")
        if nl < 0:
            return self.events
        self.off += nl + 1
        for line in data[: nl + 1].splitlines():
            if line.startswith(b"{"):
                try:
                    self.events.append(json.loads(line))
                except Exception:
                    pass
        return self.events

    def alive(self):
        return self.p.poll() is None

    def kill(self):
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.p.wait(10)

    def fds(self):
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except Exception:
            return -1


def wait_file(path, timeout, owner=None):
    dl = time.time() + timeout
    while time.time() < dl:
        if os.path.exists(path):
            s = open(path).read().strip()
            if s:
                return int(s)
        if owner and not owner.alive():
            raise RuntimeError(f"{owner.name} died before {path}")
        time.sleep(0.02)
    raise RuntimeError(f"timeout waiting {path}")


class Cluster:
    def __init__(self, d, nnodes, flags):
        self.d, self.nnodes, self.flags = d, nnodes, flags
        self.starts = {}
        self.nodes = [None] * nnodes
        self.coord = None
        self.coord_port = 0
        self.start_coord("127.0.0.1:0")
        for i in range(nnodes):
            self.start_node(i)

    def _n(self, key):
        self.starts[key] = self.starts.get(key, 0) + 1
        return self.starts[key]

    def start_coord(self, listen):
        k = self._n("coord")
        pf = f"{self.d}/coord-{k}.port"
        self.coord = Proc(self.d, f"coord-{k}", [DAEMON, "--role=coordinator", "--listen=" + listen, "--port_file=" + pf] + self.flags)
        self.coord_port = wait_file(pf, 30, self.coord)

    def restart_coord(self):
        self.start_coord(f"127.0.0.1:{self.coord_port}")

    def sock(self, i):
        return f"{self.d}/n{i}.sock"

    def start_node(self, i):
        k = self._n(f"n{i}")
        pf = f"{self.d}/n{i}-{k}.port"
        self.nodes[i] = Proc(self.d, f"n{i}-{k}", [DAEMON, "--role=node", "--listen=127.0.0.1:0", "--data_listen=127.0.0.1:0",
                                                   "--port_file=" + pf, "--worker_socket=" + self.sock(i),
                                                   f"--coordinator=127.0.0.1:{self.coord_port}", f"--node_id=n{i}"] + self.flags)
        wait_file(pf, 30, self.nodes[i])

    def daemons(self):
        return [self.coord] + self.nodes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("rounds", type=int)
    ap.add_argument("seed", type=int)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quant", default="")
    ap.add_argument("--kinds", default="node_rollout,node_trainer,coord,rollout,trainer")
    ap.add_argument("--trainer_step", type=int, default=60)
    ap.add_argument("--rollout_step", type=int, default=30)
    ap.add_argument("--max_delay", type=float, default=0.08)
    ap.add_argument("--recover_s", type=float, default=45)
    ap.add_argument("--keep_going", action="store_true")
    ap.add_argument("--delta_cache_mb", type=int, default=0)
    ap.add_argument("--delta_fraction", type=float, default=0.05)
    ap.add_argument("--delta_threads", type=int, default=0)
    ap.add_argument("--delta_in_place", default="")
    ap.add_argument("--digests", default="")
    ap.add_argument("--rollout_nodes", type=int, default=2)
    ap.add_argument("--bucket_kb", type=int, default=0)
    ap.add_argument("--nic_GBps", type=float, default=0)
    ap.add_argument("--lora", default="")
    ap.add_argument("--lora_r", type=int, default=8)
    ap.add_argument("--rollout_tp", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    d = tempfile.mkdtemp(prefix="wbchaos-")
    print(f"chaos: dir {d} mode={a.mode} seed={a.seed} model={a.model} quant={a.quant!r}", flush=True)
    flags = ["--heartbeat_ms=200", "--lease_ms=6000", "--transfer_timeout_ms=8000"] + os.environ.get("CHAOS_FLAGS", "").split()
    if a.delta_cache_mb:
        flags.append(f"--delta_cache_bytes={a.delta_cache_mb << 20}")
    if a.delta_threads:
        flags.append(f"--delta_threads={a.delta_threads}")
    if a.delta_in_place:
        flags.append("--delta_in_place=" + a.delta_in_place)
    if a.digests:
        flags.append("--digests=" + a.digests)
    if a.bucket_kb:
        flags.append(f"--bucket_bytes={a.bucket_kb << 10}")
    if a.nic_GBps:
        flags.append(f"--nic_GBps={a.nic_GBps}")
    print(f"chaos: daemon flags {flags} delta_fraction={a.delta_fraction if a.delta_cache_mb else 0} rollout_nodes={a.rollout_nodes} "
          f"rollout_tp={a.rollout_tp} lora={a.lora!r}", flush=True)
    NR = a.rollout_nodes
    TP = a.rollout_tp
    NRP = NR * TP  # rollout processes: rank r is rank r % TP of the engine on node 1 + r // TP
    c = Cluster(d, 1 + NR, flags)  # each daemon waited for through its port file
    model = "m-" + a.mode
    base = ["--config=" + MODELS[a.model], "--model_id=" + model, "--mode=" + a.mode, "--num_trainers=2", f"--num_rollouts={NRP}",
            "--max_staleness=0", "--versions=100000", "--timeout_ms=15000", "--layout_source=preset", "--tolerate_failures=true"]
    if a.delta_cache_mb:
        base.append(f"--delta_fraction={a.delta_fraction}")
    if a.lora:
        base += ["--lora_targets=" + a.lora, f"--lora_r={a.lora_r}", "--lora_alpha=16"]
    starts = {}

    def spawn_trainer(r, first):
        starts[f"t{r}"] = starts.get(f"t{r}", 0) + 1
        return Proc(d, f"trainer{r}-{starts[f't{r}']}", [TRAINER, "--socket=" + c.sock(0)] + base +
                    [f"--first_version={first}"] + (["--preset=peft", "--dp=2"] if a.lora else ["--preset=megatron", "--tp=2"]) +
                    [f"--rank={r}", f"--gpu={r}", f"--step_ms={a.trainer_step}"])

    def spawn_rollout(r):
        starts[f"r{r}"] = starts.get(f"r{r}", 0) + 1
        extra = ["--quantization=" + a.quant] if a.quant else []
        return Proc(d, f"rollout{r}-{starts[f'r{r}']}", [ROLLOUT, "--socket=" + c.sock(1 + r // TP)] + base +
                    ["--first_version=1", "--preset=" + ("vllm_lora" if a.lora else "vllm"), f"--tp={TP}", f"--replicas={NR}", f"--rank={r}",
                     f"--gpu={r % TP}",
                     f"--step_ms={a.rollout_step}"] + extra)

    trainers = [spawn_trainer(r, 1) for r in range(2)]
    rollouts = [spawn_rollout(r) for r in range(NRP)]
    dead_workers = []
    problems = []

    def all_workers():
        return trainers + rollouts + dead_workers

    def newest(evname, procs, why=None):
        m = 0
        for p in procs:
            for e in p.poll_events():
                if e.get("event") == evname and (why is None or e.get("why") == why):
                    m = max(m, e.get("version", 0))
        return m

    def check_mismatch():
        for p in all_workers():
            for e in p.poll_events():
                if e.get("event") in ("mismatch",) or (e.get("event") == "error"):
                    key = (p.name, json.dumps(e)[:300])
                    if key not in seen_problems:
                        seen_problems.add(key)
                        problems.append(f"{p.name}: {json.dumps(e)[:400]}")
            if not p.alive() and p not in dead_workers and p.p.returncode is not None:
                key = (p.name, "exit")
                if key not in seen_problems:
                    seen_problems.add(key)
                    problems.append(f"{p.name} exited unexpectedly rc={p.p.returncode}")

    seen_problems = set()

    def stale_maps():
        dead = set()
        for p in dead_workers:
            for e in p.poll_events():
                if isinstance(e.get("shm"), str):
                    dead.add(e["shm"].lstrip("/"))
        out = []
        for p in c.daemons():
            try:
                txt = open(f"/proc/{p.pid}/maps").read() + "\n".join(os.readlink(f"/proc/{p.pid}/fd/{f}") for f in os.listdir(f"/proc/{p.pid}/fd"))
            except Exception:
                continue
            for sname in dead:
                if "/dev/shm/" + sname in txt:
                    out.append((p.name, sname))
        return out

    def wait_verified(above, timeout):
        dl = time.time() + timeout
        while time.time() < dl:
            if all(newest("verified", [r], "applied") > above for r in rollouts):
                return True
            check_mismatch()
            time.sleep(0.05)
        return False

    if not wait_verified(0, 90):
        print("chaos: FAIL initial versions never verified", flush=True)
        for p in all_workers() + c.daemons():
            print(p.name, open(p.log).read()[-1500:])
        sys.exit(1)
    time.sleep(1)  # settle: the fd baseline is taken once start-up connections are made
    fd0 = {p.name: p.fds() for p in c.daemons()}
    print(f"chaos: start fds {fd0}", flush=True)
    kinds = a.kinds.split(",")
    stats = {k: [0, 0] for k in kinds}
    fd_hist = []
    classes = {}
    fd_first, fd_max = dict(fd0), {}
    t_run = time.time()
    for rnd in range(a.rounds):
        kind = kinds[rnd % len(kinds)] if rnd < len(kinds) else rng.choice(kinds)
        # the random moment: right after trainer/0's next fill or publish, plus a random delay
        t0 = trainers[0]
        n_before = len(t0.poll_events())
        dl = time.time() + 20
        trig = rng.choice(["filled", "published"])
        while time.time() < dl:
            evs = t0.poll_events()
            if any(e.get("event") == trig for e in evs[n_before:]):
                break
            time.sleep(0.002)
        time.sleep(rng.uniform(0, a.max_delay))
        pre = max(newest("filled", trainers), 0)
        tk = time.time()
        detail = ""
        if kind == "node_rollout":
            i = rng.choice(list(range(1, NR + 1)))
            c.nodes[i].kill(); c.start_node(i); detail = f"n{i}"
        elif kind == "node_trainer":
            c.nodes[0].kill(); c.start_node(0); detail = "n0"
        elif kind == "coord":
            c.coord.kill(); c.restart_coord()
        elif kind == "rollout":
            r = rng.choice(list(range(NRP)))
            old = rollouts[r]; old.kill(); dead_workers.append(old)
            rollouts[r] = spawn_rollout(r); detail = f"rollout{r}"
        elif kind == "trainer":
            # kill one rank mid-publish; its peer cannot publish alone, so the pair is restarted
            r = rng.choice([0, 1])
            trainers[r].kill()
            time.sleep(rng.uniform(0, 0.3))
            trainers[1 - r].kill()
            dead_workers.extend(trainers)
            nxt = max(newest("filled", trainers), newest("published", trainers)) + 1
            trainers = [spawn_trainer(q, nxt) for q in range(2)]
            detail = f"rank{r} first, restart at v{nxt}"
        ok = wait_verified(pre, a.recover_s)
        for ri in range(NRP):
            rp = rollouts[ri]
            if not rp.alive():
                whys = [e.get("why") for e in rp.poll_events() if e.get("event") == "mismatch"]
                cls = f"{rp.name} exited rc={rp.p.returncode} mismatch why={whys}"
                classes[str(whys)] = classes.get(str(whys), 0) + 1
                print("chaos:   respawn", cls, flush=True)
                dead_workers.append(rp)
                rollouts[ri] = spawn_rollout(ri)
                ok = ok and False
        rec = time.time() - tk
        check_mismatch()
        stats[kind][0] += 1
        stats[kind][1] += ok
        fds = {p.name: p.fds() for p in c.daemons()}
        fd_hist.append(fds)
        for k2, v2 in fds.items():
            fd_first.setdefault(k2, v2)
            fd_max[k2] = max(fd_max.get(k2, 0), v2)
        stale = stale_maps()
        if stale:
            time.sleep(1.0)  # a second look: the daemons unmap a dead worker's memory on their next liveness tick
            stale = stale_maps()
            if stale:
                problems.append(f"round {rnd}: daemons still map segments of dead workers: {stale}")
        print(f"chaos: round {rnd:3d} {kind:12s} {detail:28s} pre=v{pre:<4d} {'recovered' if ok else 'NOT RECOVERED'} in {rec:6.2f}s"
              f" verified " + " ".join(f"r{q}=v{newest('verified', [rollouts[q]], 'applied')}" for q in range(NRP)) + f" fds={fds}",
              flush=True)
        if not ok:
            problems.append(f"round {rnd} {kind} {detail}: not recovered within {a.recover_s}s (pre=v{pre})")
            st = subprocess.run([BIN + "/client/wbctl", "status", "--addr", f"127.0.0.1:{c.coord_port}"], capture_output=True, text=True, timeout=20)
            print("wbctl status:", st.stdout[-1500:], st.stderr[-500:], flush=True)
            if not a.keep_going:
                break
    # end: drain, collect
    check_mismatch()
    fd_end = {p.name: p.fds() for p in c.daemons()}
    applied = {r.name: len([e for e in r.poll_events() if e.get("event") == "verified" and e.get("why") == "applied"]) for r in rollouts + [w for w in dead_workers if "rollout" in w.name]}
    failed = sum(len([e for e in r.poll_events() if e.get("event") == "version_failed"]) for r in rollouts + dead_workers)
    after_fail = sum(len([e for e in r.poll_events() if e.get("event") == "verified" and e.get("why") == "after_failure"]) for r in rollouts + dead_workers)
    # shm: segments announced by exited (cleanly) workers must be gone; killed ones are orphans
    shm = []
    for p in all_workers():
        for e in p.poll_events():
            if isinstance(e.get("shm"), str):
                shm.append((p.name, e["shm"], p.alive()))
    # daemon logs
    errs = {}
    msgs = {}
    for name in sorted(os.listdir(d)):
        if name.startswith(("coord", "n")) and name.endswith(".log"):
            for line in open(os.path.join(d, name), errors="replace"):
                if re.search(r"level=error|level=fatal|FATAL|Check failed|terminate|AddressSanitizer|panic|double free|Segmentation", line):
                    errs.setdefault(name, []).append(line.rstrip()[:300])
                m = re.search(r'level=(warning|error|fatal) msg="([^"]*)"', line)
                if m:
                    msgs[m.group(1) + ": " + m.group(2)] = msgs.get(m.group(1) + ": " + m.group(2), 0) + 1
    # issue-17 feature usage from the node logs: deltas, digests, relays, sender quantisation
    feat = {}
    refusals = {}
    verrs = {}
    def kv(line):
        return dict((m.group(1), m.group(2).strip('"')) for m in re.finditer(r'(\w+)=("[^"]*"|\S+)', line))
    for name in sorted(os.listdir(d)):
        if not (name.startswith("n") and name.endswith(".log")):
            continue
        node = name.split("-")[0]
        for line in open(os.path.join(d, name), errors="replace"):
            if 'msg="version transferred"' in line:
                f = kv(line)
                for k in ("delta_ops", "delta_bytes", "delta_replaced_bytes", "delta_full_bytes", "delta_fallbacks", "delta_fallback_bytes",
                          "delta_decoded", "delta_decoded_in_place", "digest_bytes", "relay_bytes_at_commit", "bytes"):
                    try:
                        feat[(node, k)] = feat.get((node, k), 0) + float(f.get(k, 0))
                    except ValueError:
                        pass
                feat[(node, "versions")] = feat.get((node, "versions"), 0) + 1
                if f.get("delta_refusal"):
                    refusals[f["delta_refusal"][:160]] = refusals.get(f["delta_refusal"][:160], 0) + 1
                if f.get("error"):
                    verrs[f["error"][:200]] = verrs.get(f["error"][:200], 0) + 1
            if "digest" in line and ("mismatch" in line or "differ" in line):
                problems.append(f"{name}: digest line: {line.strip()[:300]}")
    for node in sorted(set(n for n, _ in feat)):
        print(f"chaos: node {node}: " + " ".join(f"{k}={feat[(n, k)]:.0f}" for (n, k) in sorted(feat) if n == node), flush=True)
    for k, v in sorted(refusals.items()):
        print(f"chaos: delta refusal x{v}: {k}")
    for k, v in sorted(verrs.items()):
        print(f"chaos: version transferred error x{v}: {k}")
    try:
        st = subprocess.run([BIN + "/client/wbctl", "versions", "--addr", f"127.0.0.1:{c.coord_port}", "--model", model], capture_output=True, text=True, timeout=20)
        print("chaos: wbctl versions (tail):\n" + "\n".join(st.stdout.splitlines()[-8:]) + st.stderr[-300:], flush=True)
    except Exception as e:
        print("chaos: wbctl versions failed", e)
    # SIGTERM exit of daemons
    for p in c.daemons():
        os.kill(p.pid, signal.SIGTERM)
    for p in c.daemons():
        try:
            rc = p.p.wait(20)
        except subprocess.TimeoutExpired:
            rc = "HANG"; p.kill()
        if rc != 0:
            problems.append(f"{p.name} SIGTERM exit rc={rc}")
    for p in all_workers():
        if p.alive():
            p.kill()
    leaked = []
    for (n, s, _) in shm:
        if os.path.exists("/dev/shm/" + s.lstrip("/")):
            leaked.append((n, s))
            try:
                os.unlink("/dev/shm/" + s.lstrip("/"))
            except Exception:
                pass
    print(f"chaos: RESULT mode={a.mode} seed={a.seed} model={a.model} quant={a.quant!r} rounds={sum(v[0] for v in stats.values())} "
          f"stats(kind: rounds,recovered)={stats} elapsed={time.time()-t_run:.1f}s", flush=True)
    print(f"chaos: verified-applied per rollout process {applied}; version_failed {failed}; after_failure verified {after_fail}")
    print(f"chaos: fds start {fd0} end {fd_end}")
    print(f"chaos: fd growth per daemon incarnation (first->max over rounds, rounds alive): " + ", ".join(f"{k}:{fd_first[k]}->{fd_max.get(k, fd_first[k])}/{sum(1 for h in fd_hist if k in h)}" for k in fd_first))
    print(f"chaos: shm segments announced {len(shm)}; still present after kill of all (worker-owned orphans) {len(leaked)}")
    for k, v in errs.items():
        print(f"chaos: log error-ish lines in {k}: {len(v)}; first: {v[:3]}")
    for k, v in sorted(msgs.items()):
        print(f"chaos: daemon log {k!r} x{v}")
    print(f"chaos: rollout deaths by mismatch class {classes}")
    print(f"chaos: problems {len(problems)}")
    for p in problems[:40]:
        print("  PROBLEM", p)
    print(f"chaos: dir {d}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The main job (make demo): WeightBridge moving Qwen2.5-0.5B weights between a Megatron tp=2
trainer and two vLLM tp=1 rollout replicas through a standalone weightbridged, in sync,
one-step-off and async modes, every rollout byte verified; then the same with rank0_broadcast.

Workers are the C++ test workers (tests/e2e/trainer_worker, rollout_worker: real preset layouts,
weights generated per version by tests/common/weight_gen.h, every byte checked after each update);
this script starts a fresh daemon per run, streams their progress lines, reads per-version figures
from the daemon's Status (through the Python client) and prints the table. Exit 0 only when every
worker exited 0, every rollout verified its last version and no byte mismatched.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

T0 = time.monotonic()
# Specs shipped with the repository whose predictions end the demo (Kimi-K2 and DeepSeek-V3 clusters).
DEFAULT_PREDICT_SPECS = ["examples/specs/kimi-k2_256to128.json", "examples/specs/deepseek-v3_pp16ep16_to_tp32dp8.json"]


def say(msg):
    print("[%6.1fs] %s" % (time.monotonic() - T0, msg), flush=True)


class Proc:
    """A child whose stdout JSON lines are collected by a reader thread (no polling)."""

    def __init__(self, name, argv, log_dir, on_event=None):
        self.name = name
        self.events = []
        self.log = open(os.path.join(log_dir, name.replace("/", "_") + ".log"), "w")
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.on_event = on_event
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.log.write(line)
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.events.append(ev)
            if self.on_event:
                self.on_event(self.name, ev)

    def wait(self, timeout):
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait(timeout=10)
        self.t.join(10)
        self.log.close()
        return rc


def run_one(args, strategy, mode, work):
    """One model run; returns (rows, failures)."""
    import weightbridge as wb

    run_dir = os.path.join(work, "%s-%s" % (strategy, mode))
    os.makedirs(run_dir)
    sock = os.path.join(run_dir, "w.sock")
    daemon_log = open(os.path.join(run_dir, "daemon.log"), "w")
    daemon = subprocess.Popen([os.path.join(args.bin, "daemon", "weightbridged"), "--role=standalone",
                               "--worker_socket=" + sock, "--listen=127.0.0.1:0",
                               "--port_file=" + os.path.join(run_dir, "port"),
                               "--transfer_timeout_ms=%d" % (args.timeout_s * 1000)]
                              # The daemon's default lease is used unless asked otherwise (a standalone
                              # daemon never expires its own in-process node).
                              + (["--lease_ms=%d" % args.lease_ms] if args.lease_ms > 0 else [])
                              + args.daemon_flag,
                              stdout=daemon_log, stderr=subprocess.STDOUT)
    failures = []
    try:
        status_client = wb.WorkerClient(sock, connect_timeout=30)  # waits for the socket
        common = ["--socket=" + sock, "--config=" + args.config, "--model_id=qwen", "--num_trainers=2",
                  "--num_rollouts=%d" % args.replicas, "--mode=" + mode, "--strategy=" + strategy,
                  "--versions=%d" % args.versions, "--timeout_ms=%d" % (args.timeout_s * 1000),
                  "--layout_source=" + args.layout_source]

        def progress(name, ev):
            e = ev.get("event")
            if e in ("published", "applied"):
                say("%s/%s %s %s v%s (stall %.3fs)" % (strategy, mode, name, e, ev.get("version"), ev.get("stall_s", 0)))
            elif e == "verified" and ev.get("why") == "applied":
                say("%s/%s %s verified v%s: %.0f MB, every byte" % (strategy, mode, name, ev["version"], ev["bytes"] / 1e6))
            elif e in ("mismatch", "error", "publish_failed", "version_failed"):
                say("%s/%s %s %s: %s" % (strategy, mode, name, e.upper(), json.dumps(ev)))

        procs = []
        for r in range(2):
            procs.append(Proc("trainer/%d" % r, [os.path.join(args.bin, "tests", "e2e", "trainer_worker")] + common +
                              ["--preset=megatron", "--tp=2", "--rank=%d" % r, "--step_ms=%d" % args.train_ms],
                              run_dir, progress))
        for r in range(args.replicas):
            procs.append(Proc("rollout/%d" % r, [os.path.join(args.bin, "tests", "e2e", "rollout_worker")] + common +
                              ["--preset=vllm", "--tp=1", "--replicas=%d" % args.replicas, "--rank=%d" % r,
                               "--step_ms=%d" % args.rollout_ms], run_dir, progress))
        for p in procs:
            rc = p.wait(args.timeout_s * (args.versions + 2))
            if rc != 0:
                failures.append("%s/%s: %s exited %d (log %s)" % (strategy, mode, p.name, rc, p.log.name))
            if any(e.get("event") == "mismatch" for e in p.events):
                failures.append("%s/%s: %s saw mismatching bytes" % (strategy, mode, p.name))
        for p in procs[2:]:
            done = [e for e in p.events if e.get("event") == "done"]
            verified = {e["version"] for e in p.events if e.get("event") == "verified" and e.get("why") == "applied"}
            if not done or args.versions not in verified:
                failures.append("%s/%s: %s did not verify the last version %d" % (strategy, mode, p.name, args.versions))
        st = status_client.status()
        status_client.close()
        rows = []
        for v in range(1, args.versions + 1):
            vs = [x for x in st.versions if x.model_id == "qwen" and x.version == v]
            tstall = [e["stall_s"] for p in procs[:2] for e in p.events if e.get("event") == "published" and e.get("version") == v]
            rstall = [e["stall_s"] for p in procs[2:] for e in p.events if e.get("event") == "applied" and e.get("version") == v]
            row = {"strategy": strategy, "mode": mode, "version": v,
                   "state": vs[0].state if vs else "?", "bytes": vs[0].bytes_total if vs else 0,
                   "seconds": vs[0].seconds if vs else 0.0,
                   "trainer_stall_s": max(tstall) if tstall else None,
                   "rollout_stall_s": max(rstall) if rstall else None,
                   "rollouts_applied": len(rstall)}
            rows.append(row)
        return rows, failures
    except Exception as e:  # report, never hang: every child is killed below
        failures.append("%s/%s: %s" % (strategy, mode, e))
        return [], failures
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
        daemon_log.close()


def fmt(x, spec):
    return "-" if x is None else spec % x


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def summarize(rows):
    """Per (mode, strategy): the first version apart, steady state = median of versions >= 2."""
    out = {}
    for r in rows:
        if r["state"] != "committed":  # a superseded version moved nothing (one-step-off / async skip it)
            continue
        key = (r["mode"], r["strategy"])
        d = out.setdefault(key, {"first": None, "steady": []})
        if r["version"] == 1:
            d["first"] = r
        else:
            d["steady"].append(r)
    summary = {}
    for key, d in out.items():
        steady = d["steady"] or ([d["first"]] if d["first"] else [])
        summary[key] = {
            "update_s": median([r["seconds"] for r in steady]),
            "bytes": median([r["bytes"] for r in steady]),
            "trainer_stall_s": median([r["trainer_stall_s"] for r in steady]),
            "rollout_stall_s": median([r["rollout_stall_s"] for r in steady]),
            "first_s": d["first"]["seconds"] if d["first"] else None,
        }
    return summary


def print_summary(rows, modes, strategies, model_bytes):
    """The table a user reads at a glance: per mode, WeightBridge next to rank0_broadcast."""
    summary = summarize(rows)
    print("Summary: steady-state update (median of committed versions >= 2; version 1 shown apart), same daemons, same workers")
    hdr = "%-13s %-16s %10s %10s %9s %14s %14s %12s" % ("mode", "strategy", "update_s", "GB_moved", "speedup",
                                                        "trainer_stall", "rollout_stall", "first_ver_s")
    print(hdr)
    print("-" * len(hdr))
    for mode in modes:
        base = summary.get((mode, "rank0_broadcast"), {}).get("update_s")
        for strategy in strategies:
            d = summary.get((mode, strategy))
            if not d:
                continue
            speed = base / d["update_s"] if base and d["update_s"] else None
            print("%-13s %-16s %10s %10s %9s %14s %14s %12s" % (
                mode, strategy, fmt(d["update_s"], "%.3f"), fmt(d["bytes"] and d["bytes"] / 1e9, "%.2f"),
                fmt(speed, "%.2fx"), fmt(d["trainer_stall_s"], "%.3fs"), fmt(d["rollout_stall_s"], "%.3fs"),
                fmt(d["first_s"], "%.3f")))
    print()
    print("  update_s: the daemon's time from Publish to the version committed (Status.versions.seconds).")
    print("  GB_moved: bytes copied for one version: each rollout replica receives the whole model (%.2f GB);" % (model_bytes / 1e9))
    print("            rank0_broadcast first gathers every shard on trainer rank 0, then sends from there.")
    print("  trainer_stall: Publish's time (sync waits for the commit; one-step-off/async return after the snapshot).")
    print("  rollout_stall: sync: BeginUpdate+WaitVersion; otherwise Apply (copy of a committed version into live weights).")
    print("  first_ver_s: version 1 also allocates host staging (fresh pages the kernel zero-fills), registers every")
    print("               worker's memory with the transports and sets up channels; later versions reuse all of it.")


def print_predictions(args):
    """The planner's prediction for real clusters (wbctl plan), next to rank0_broadcast's."""
    wbctl = os.path.join(args.bin, "client", "wbctl")
    specs = [s for s in args.predict.split(",") if s]
    if not specs or not os.path.exists(wbctl):
        return
    print()
    print("Planner predictions for real clusters (wbctl plan --spec FILE --json; 400 Gb/s NIC per GPU, bf16):")
    hdr = "%-40s %12s %14s %16s %9s" % ("spec", "makespan_s", "lower_bound_s", "rank0_broadcast_s", "speedup")
    print(hdr)
    print("-" * len(hdr))
    for spec in specs:
        path = spec if os.path.isabs(spec) else os.path.join(ROOT, spec)
        if not os.path.exists(path):
            print("%-40s (spec not found)" % os.path.basename(spec))
            continue
        try:
            out = subprocess.run([wbctl, "plan", "--spec", path, "--json"], capture_output=True, text=True, timeout=300)
            j = json.loads(out.stdout)
        except (subprocess.TimeoutExpired, ValueError) as e:
            print("%-40s (wbctl plan failed: %s)" % (os.path.basename(spec), e))
            continue
        r0 = j.get("baselines", {}).get("rank0_broadcast")
        print("%-40s %12.3f %14.3f %16s %9s" % (os.path.basename(spec).replace(".json", ""), j["makespan_s"], j["lower_bound_s"],
                                                 fmt(r0, "%.3f"), fmt(r0 / j["makespan_s"] if r0 and j["makespan_s"] else None, "%.1fx")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--config", default=os.path.join(ROOT, "tests", "e2e", "testdata", "qwen2.5-0.5b.json"))
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--modes", default="sync,one_step_off,async")
    ap.add_argument("--strategies", default="weightbridge,rank0_broadcast")
    ap.add_argument("--train_ms", type=int, default=0, help="simulated training step per version")
    ap.add_argument("--rollout_ms", type=int, default=0, help="simulated generation step per version")
    ap.add_argument("--timeout_s", type=int, default=60)
    ap.add_argument("--layout_source", default="preset", help="preset (by name, resolved by the daemon) | pieces (explicit)")
    ap.add_argument("--lease_ms", type=int, default=0, help="daemon --lease_ms (0 = the daemon's default)")
    ap.add_argument("--daemon_flag", action="append", default=[], help="extra weightbridged flag (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep logs in the work dir")
    ap.add_argument("--predict", default=",".join(DEFAULT_PREDICT_SPECS),
                    help="comma-separated plan specs for the planner's predictions on real clusters ('' = none)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="wbdemo.")
    say("Qwen2.5-0.5B (%s), trainer megatron tp=2 -> %d x vllm tp=1, %d versions per mode; logs in %s"
        % (os.path.basename(args.config), args.replicas, args.versions, work))
    rows, failures = [], []
    for strategy in args.strategies.split(","):
        for mode in args.modes.split(","):
            say("=== %s / %s" % (strategy, mode))
            r, f = run_one(args, strategy, mode, work)
            rows += r
            failures += f
    print()
    hdr = "%-16s %-13s %3s %-10s %12s %9s %7s %14s %14s" % ("strategy", "mode", "ver", "state", "bytes", "seconds",
                                                             "GB/s", "trainer_stall", "rollout_stall")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else None
        print("%-16s %-13s %3d %-10s %12d %9.3f %7s %14s %14s" % (
            r["strategy"], r["mode"], r["version"], r["state"], r["bytes"], r["seconds"], fmt(gbps, "%.2f"),
            fmt(r["trainer_stall_s"], "%.3fs"), fmt(r["rollout_stall_s"], "%.3fs")))
    with open(os.path.join(work, "demo.json"), "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)
    print()
    if rows:
        model_bytes = min((r["bytes"] for r in rows if r["strategy"] == "weightbridge" and r["bytes"]), default=0) / max(1, args.replicas)
        print_summary(rows, args.modes.split(","), args.strategies.split(","), model_bytes)
    print_predictions(args)
    print()
    if failures:
        for f in failures:
            print("CHECK FAILED:", f)
        print("demo: %d check(s) failed; logs kept in %s" % (len(failures), work))
        return 1
    say("demo: all checks passed (every rollout byte verified in every mode)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

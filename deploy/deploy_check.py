"""Consistency checker for deploy/: systemd units, environment files, Kubernetes manifests, Containerfile.

Everything is checked against the real daemon: the flag set comes from `weightbridged --helpfull`, so a
manifest that passes a flag the binary does not have, a probe on a port the daemon does not listen on,
or a socket path the workers will not find, fails here instead of on a cluster.

Usage: deploy_check.py DEPLOY_DIR WEIGHTBRIDGED_BINARY   (exit 1 and one line per problem)
Library: check(deploy_dir, helpfull_text) -> list of error strings (empty = consistent).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

# Where the checked files are expected to be installed; the units name these paths.
ENV_INSTALL_DIR = "/etc/weightbridge/"
BINARY_INSTALL_PATH = "/usr/local/bin/weightbridged"
ROLES = ("node", "coordinator", "standalone")
# The env variable rollout containers use to find the node daemon's socket.
SOCKET_ENV = "WEIGHTBRIDGE_SOCKET"


def parse_helpfull(text):
    """Returns (all_flags, daemon_flags): every flag name the binary accepts, and those it defines itself.

    `--helpfull` groups flags under "Flags from <file>:"; the daemon's own flags are those whose file is
    not part of abseil (absl/...). The help text is the contract, so nothing is hard-coded here.
    """
    all_flags, daemon_flags = set(), set()
    source = None
    for line in text.splitlines():
        m = re.match(r"^\s*Flags from (\S+):\s*$", line)
        if m:
            source = m.group(1)
            continue
        m = re.match(r"^\s{2,}--([A-Za-z0-9_]+) \(", line)
        if m and source is not None:
            all_flags.add(m.group(1))
            if not source.lstrip("./").startswith("absl/"):
                daemon_flags.add(m.group(1))
    return all_flags, daemon_flags


def split_flag(arg):
    """'--name=value' -> ('name', 'value'); '--name' -> ('name', None); anything else -> (None, None)."""
    m = re.match(r"^--([A-Za-z0-9_]+)(?:=(.*))?$", arg)
    if not m:
        return None, None
    return m.group(1), m.group(2)


def port_of(address):
    """'host:1234' -> 1234, None when there is no numeric port."""
    if address is None or ":" not in address:
        return None
    tail = address.rsplit(":", 1)[1]
    return int(tail) if tail.isdigit() else None


# ----------------------------------------------------------------------------------------------------
# systemd


def read_unit(path):
    """Parses a unit file (continuation lines joined, repeated keys kept) into {section: [(key, value)]}."""
    sections, current = {}, None
    with open(path) as f:
        lines = f.read().splitlines()
    joined, buf = [], ""
    for line in lines:
        if buf:
            buf += " " + line.strip()
        else:
            buf = line
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        joined.append(buf)
        buf = ""
    if buf:
        joined.append(buf)
    for lineno, line in enumerate(joined, 1):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith(";"):
            continue
        if s.startswith("[") and s.endswith("]"):
            current = s[1:-1]
            sections.setdefault(current, [])
            continue
        if "=" not in s or current is None:
            raise ValueError(f"{path}: cannot parse line {lineno!r}: {s}")
        key, value = s.split("=", 1)
        sections[current].append((key.strip(), value.strip()))
    return sections


def read_env_file(path):
    """Parses a systemd EnvironmentFile (KEY=VALUE lines, comments) into a dict; raises on junk."""
    env = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", s)
            if not m:
                raise ValueError(f"{path}:{lineno}: not KEY=VALUE: {s}")
            if m.group(1) in env:
                raise ValueError(f"{path}:{lineno}: {m.group(1)} set twice")
            env[m.group(1)] = m.group(2)
    return env


def env_var_for(flag):
    return "WB_" + flag.upper()


def check_systemd(deploy_dir, all_flags, daemon_flags, errors, facts):
    unit_dir = os.path.join(deploy_dir, "systemd")
    units = sorted(f for f in os.listdir(unit_dir) if f.endswith(".service"))
    if not units:
        errors.append(f"{unit_dir}: no .service units")
    roles_seen = set()
    for unit in units:
        where = f"systemd/{unit}"
        try:
            sections = read_unit(os.path.join(unit_dir, unit))
        except (OSError, ValueError) as e:
            errors.append(f"{where}: {e}")
            continue
        for needed in ("Unit", "Service", "Install"):
            if needed not in sections:
                errors.append(f"{where}: no [{needed}] section")
        service = dict(sections.get("Service", []))
        service_multi = sections.get("Service", [])
        if service.get("Restart") not in ("on-failure", "always", "on-abnormal"):
            errors.append(f"{where}: Restart= must restart a crashed daemon, got {service.get('Restart')!r}")
        execs = [v for k, v in service_multi if k == "ExecStart"]
        if len(execs) != 1:
            errors.append(f"{where}: expected exactly one ExecStart, found {len(execs)}")
            continue
        argv = execs[0].split()
        if argv[0] != BINARY_INSTALL_PATH:
            errors.append(f"{where}: ExecStart runs {argv[0]}, expected {BINARY_INSTALL_PATH}")
        env_files = [v.lstrip("-") for k, v in service_multi if k == "EnvironmentFile"]
        env = {}
        env_where = None
        for ef in env_files:
            if not ef.startswith(ENV_INSTALL_DIR):
                errors.append(f"{where}: EnvironmentFile {ef} is not under {ENV_INSTALL_DIR}")
                continue
            local = os.path.join(unit_dir, ef[len(ENV_INSTALL_DIR):])
            env_where = f"systemd/{os.path.basename(local)}"
            try:
                env.update(read_env_file(local))
            except (OSError, ValueError) as e:
                errors.append(f"{where}: EnvironmentFile {ef}: {e}")
        if not env_files:
            errors.append(f"{where}: no EnvironmentFile (every flag must be settable there)")
        passed = {}
        for arg in argv[1:]:
            name, value = split_flag(arg)
            if name is None:
                errors.append(f"{where}: ExecStart argument {arg!r} is not --flag=value")
                continue
            if name not in all_flags:
                errors.append(f"{where}: ExecStart passes --{name}, which weightbridged does not have "
                              f"(its flags: {', '.join(sorted(daemon_flags))})")
            passed[name] = value
            for var in re.findall(r"\$\{([A-Za-z0-9_]+)\}|\$([A-Za-z0-9_]+)", value or ""):
                var = var[0] or var[1]
                if env_files and var not in env:
                    errors.append(f"{where}: ExecStart uses ${{{var}}} for --{name} but {env_where} does not set it")
            expected = "${" + env_var_for(name) + "}"
            if value != expected:
                errors.append(f"{where}: --{name} should be passed as --{name}={expected}, got {value!r}")
        for flag in sorted(daemon_flags - set(passed)):
            errors.append(f"{where}: weightbridged flag --{flag} is not passed in ExecStart "
                          f"(add --{flag}=${{{env_var_for(flag)}}})")
        if env_where:
            for flag in sorted(daemon_flags):
                if env_var_for(flag) not in env:
                    errors.append(f"{env_where}: weightbridged flag --{flag} has no {env_var_for(flag)}= line")
            known = {env_var_for(f) for f in all_flags}
            for var in sorted(env):
                if var.startswith("WB_") and var not in known:
                    errors.append(f"{env_where}: {var} matches no weightbridged flag (--{var[3:].lower()} does not exist)")
        role = env.get("WB_ROLE")
        if role not in ROLES:
            errors.append(f"{env_where or where}: WB_ROLE must be one of {ROLES}, got {role!r}")
            continue
        roles_seen.add(role)
        runtime_dirs = service.get("RuntimeDirectory", "").split()
        if role in ("node", "standalone"):
            sock = env.get("WB_WORKER_SOCKET", "")
            if not sock.startswith("/run/"):
                errors.append(f"{env_where}: WB_WORKER_SOCKET must be under /run/ (the unit's RuntimeDirectory), got {sock!r}")
            else:
                sock_dir = os.path.dirname(sock)[len("/run/"):]
                if sock_dir not in runtime_dirs:
                    errors.append(f"{where}: RuntimeDirectory={' '.join(runtime_dirs) or '(none)'} does not create "
                                  f"the socket directory /run/{sock_dir} of WB_WORKER_SOCKET={sock}")
                facts.setdefault("systemd_socket", sock)
            mode = service.get("RuntimeDirectoryMode", "0755")
            if int(mode, 8) & 0o007:
                errors.append(f"{where}: RuntimeDirectoryMode={mode} lets other users reach the worker socket (want 0750)")
            if service.get("PrivateDevices", "no") in ("yes", "true", "1"):
                errors.append(f"{where}: PrivateDevices=yes hides /dev/nvidia* from the node daemon")
            if service.get("DevicePolicy") in ("closed", "strict"):
                allowed = " ".join(v for k, v in service_multi if k == "DeviceAllow")
                if "nvidia" not in allowed:
                    errors.append(f"{where}: DevicePolicy={service['DevicePolicy']} without a DeviceAllow for the NVIDIA devices")
            if service.get("PrivateIPC", "no") in ("yes", "true", "1"):
                errors.append(f"{where}: PrivateIPC=yes hides the workers' shared memory from the node daemon")
        for addr_flag in ("listen", "data_listen"):
            addr = env.get(env_var_for(addr_flag))
            if addr is not None and port_of(addr) is None:
                errors.append(f"{env_where}: {env_var_for(addr_flag)}={addr!r} has no numeric port")
        if role == "node":
            if port_of(env.get("WB_LISTEN")) == 0:
                errors.append(f"{env_where}: a node's WB_LISTEN needs a fixed port (other daemons and probes reach it)")
            facts.setdefault("systemd_coordinator_target", env.get("WB_COORDINATOR"))
        if role == "coordinator":
            facts.setdefault("systemd_coordinator_port", port_of(env.get("WB_LISTEN")))
    for role in ("node", "coordinator"):
        if role not in roles_seen:
            errors.append(f"systemd/: no unit runs --role={role}")
    if "systemd_coordinator_target" in facts and "systemd_coordinator_port" in facts:
        if port_of(facts["systemd_coordinator_target"]) != facts["systemd_coordinator_port"]:
            errors.append(f"systemd/: node.env WB_COORDINATOR={facts['systemd_coordinator_target']} does not use the "
                          f"coordinator's WB_LISTEN port {facts['systemd_coordinator_port']}")


def verify_units_with_systemd(deploy_dir, binary, errors):
    """Runs `systemd-analyze verify` (if installed) on copies that point at the real binary and env files.

    systemd accepts unknown keys with a warning and exit 0, so any warning about the unit is an error here.
    """
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        return False
    unit_dir = os.path.join(deploy_dir, "systemd")
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for unit in sorted(f for f in os.listdir(unit_dir) if f.endswith(".service")):
            with open(os.path.join(unit_dir, unit)) as f:
                text = f.read()
            text = text.replace(BINARY_INSTALL_PATH, os.path.abspath(binary))
            text = text.replace(ENV_INSTALL_DIR, os.path.abspath(unit_dir) + "/")
            path = os.path.join(tmp, unit)
            with open(path, "w") as f:
                f.write(text)
            paths.append(path)
        if not paths:
            return True
        r = subprocess.run([analyze, "verify", "--man=no", *paths], capture_output=True, text=True, timeout=60)
        for line in (r.stdout + r.stderr).splitlines():
            if tmp in line:
                errors.append("systemd-analyze verify: " + line.replace(tmp + "/", "systemd/"))
        if r.returncode != 0 and not any(tmp in l for l in (r.stdout + r.stderr).splitlines()):
            errors.append(f"systemd-analyze verify failed (rc {r.returncode}): {r.stderr.strip()}")
    return True


# ----------------------------------------------------------------------------------------------------
# Kubernetes


def pod_spec_of(doc):
    kind = doc.get("kind")
    if kind == "Pod":
        return doc.get("spec") or {}
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
        return ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    return None


def pod_labels_of(doc):
    if doc.get("kind") == "Pod":
        return (doc.get("metadata") or {}).get("labels") or {}
    return (((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}


def is_weightbridged(container):
    cmd = (container.get("command") or []) + (container.get("args") or [])
    return bool(cmd) and os.path.basename(str(cmd[0])) == "weightbridged"


def container_flags(container, all_flags, daemon_flags, where, errors):
    flags = {}
    argv = (container.get("command") or [])[1:] + (container.get("args") or [])
    env_names = {e.get("name") for e in container.get("env") or []}
    for arg in argv:
        arg = str(arg)
        name, value = split_flag(arg)
        if name is None:
            errors.append(f"{where}: argument {arg!r} is not --flag=value")
            continue
        if name not in all_flags:
            errors.append(f"{where}: passes --{name}, which weightbridged does not have "
                          f"(its flags: {', '.join(sorted(daemon_flags))})")
        if name in flags:
            errors.append(f"{where}: --{name} given twice")
        flags[name] = value
        for var in re.findall(r"\$\(([A-Za-z0-9_]+)\)", value or ""):
            if var not in env_names:
                errors.append(f"{where}: --{name} uses $({var}) but the container sets no env {var}")
    return flags


def probe_ports(container):
    out = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if not probe:
            continue
        if "grpc" in probe:
            out.append((kind, "grpc", probe["grpc"].get("port")))
        elif "tcpSocket" in probe:
            out.append((kind, "tcpSocket", probe["tcpSocket"].get("port")))
        elif "httpGet" in probe:
            out.append((kind, "httpGet", probe["httpGet"].get("port")))
        else:
            out.append((kind, "exec", None))
    return out


def resolve_port(container, port):
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def mount_for(container, path):
    """The volumeMount whose mountPath contains path (longest match), or None."""
    best = None
    for m in container.get("volumeMounts") or []:
        mp = m.get("mountPath", "").rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best.get("mountPath", "")):
                best = m
    return best


def check_k8s(deploy_dir, all_flags, daemon_flags, errors, facts):
    k8s_dir = os.path.join(deploy_dir, "k8s")
    docs = []
    for root, _, files in os.walk(k8s_dir):
        for f in sorted(files):
            if not f.endswith((".yaml", ".yml")):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, deploy_dir)
            try:
                with open(path) as fh:
                    loaded = [d for d in yaml.safe_load_all(fh) if d is not None]
            except yaml.YAMLError as e:
                errors.append(f"{rel}: YAML does not parse: {e}")
                continue
            for d in loaded:
                if not isinstance(d, dict) or not d.get("apiVersion") or not d.get("kind") or \
                        not (d.get("metadata") or {}).get("name"):
                    errors.append(f"{rel}: a document lacks apiVersion, kind or metadata.name")
                    continue
                docs.append((rel, d))
    if not docs:
        errors.append(f"{k8s_dir}: no manifests")
        return

    services = [(rel, d) for rel, d in docs if d["kind"] == "Service"]
    daemons = []  # (rel, doc, pod_spec, container, flags, where)
    for rel, d in docs:
        spec = pod_spec_of(d)
        if spec is None:
            continue
        name = d["metadata"]["name"]
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            where = f"{rel}: {d['kind']} {name} container {c.get('name')}"
            if not is_weightbridged(c):
                continue
            if (c.get("command") or [""])[0] != BINARY_INSTALL_PATH:
                errors.append(f"{where}: command must be {BINARY_INSTALL_PATH} (the image's path)")
            flags = container_flags(c, all_flags, daemon_flags, where, errors)
            daemons.append((rel, d, spec, c, flags, where))
            role = flags.get("role")
            if role not in ROLES:
                errors.append(f"{where}: --role must be one of {ROLES}, got {role!r}")
                continue
            listen_port = port_of(flags.get("listen"))
            if not listen_port:
                errors.append(f"{where}: --listen needs a fixed, non-zero port for probes and peers, got {flags.get('listen')!r}")
            container_ports = {p.get("containerPort") for p in c.get("ports") or []}
            if listen_port and listen_port not in container_ports:
                errors.append(f"{where}: --listen port {listen_port} is not among containerPorts {sorted(container_ports)}")
            probes = probe_ports(c)
            kinds = {k for k, _, _ in probes}
            if "livenessProbe" not in kinds or not ({"readinessProbe", "startupProbe"} & kinds):
                errors.append(f"{where}: needs a livenessProbe and a readiness or startup probe")
            for kind, how, port in probes:
                if how != "grpc":
                    errors.append(f"{where}: {kind} is {how}; use a grpc probe (grpc.health.v1 is served)")
                    continue
                resolved = resolve_port(c, port)
                if resolved != listen_port:
                    errors.append(f"{where}: {kind} probes port {port} but --listen is {flags.get('listen')} "
                                  f"(grpc.health.v1 is only on the --listen port)")
            if spec.get("hostNetwork"):
                for p in c.get("ports") or []:
                    if p.get("hostPort") not in (None, p.get("containerPort")):
                        errors.append(f"{where}: with hostNetwork, hostPort {p.get('hostPort')} must equal containerPort {p.get('containerPort')}")
            if role in ("node", "standalone"):
                data_port = port_of(flags.get("data_listen"))
                if not data_port:
                    errors.append(f"{where}: --data_listen needs a fixed port, got {flags.get('data_listen')!r}")
                elif data_port not in container_ports:
                    errors.append(f"{where}: --data_listen port {data_port} is not among containerPorts {sorted(container_ports)}")
                for addr_flag in ("listen", "data_listen"):
                    host = (flags.get(addr_flag) or "").rsplit(":", 1)[0]
                    if host in ("0.0.0.0", "", "[::]", "127.0.0.1", "localhost"):
                        errors.append(f"{where}: --{addr_flag}={flags.get(addr_flag)} is announced to peers as is; "
                                      f"use the node/pod IP (e.g. $(HOST_IP))")
                sock = flags.get("worker_socket")
                if not sock:
                    errors.append(f"{where}: role {role} needs --worker_socket")
                elif not mount_for(c, sock):
                    errors.append(f"{where}: --worker_socket {sock} is not on a mounted volume (workers could not reach it)")

    # Nodes -> coordinator Service.
    coordinators = [x for x in daemons if x[4].get("role") == "coordinator"]
    if not coordinators:
        errors.append("k8s/: no weightbridged --role=coordinator")
    if not any(x[1]["kind"] == "DaemonSet" and x[4].get("role") == "node" for x in daemons):
        errors.append("k8s/: no DaemonSet runs weightbridged --role=node")
    for rel, d, spec, c, flags, where in daemons:
        if flags.get("role") != "node":
            continue
        target = flags.get("coordinator") or ""
        host, port = target.rsplit(":", 1)[0] if ":" in target else target, port_of(target)
        svc_name = host.split(".")[0]
        svc_ns = host.split(".")[1] if host.count(".") >= 1 else d["metadata"].get("namespace")
        match = [s for s in services if s[1]["metadata"]["name"] == svc_name and
                 s[1]["metadata"].get("namespace") == svc_ns]
        if not match:
            errors.append(f"{where}: --coordinator={target} names no Service {svc_name} in namespace {svc_ns}")
            continue
        srel, svc = match[0]
        sports = (svc.get("spec") or {}).get("ports") or []
        sp = [p for p in sports if p.get("port") == port]
        if not sp:
            errors.append(f"{where}: --coordinator port {port} is not a port of Service {svc_name} "
                          f"({[p.get('port') for p in sports]})")
            continue
        selector = (svc.get("spec") or {}).get("selector") or {}
        backends = [x for x in coordinators if selector and
                    all(pod_labels_of(x[1]).get(k) == v for k, v in selector.items())]
        if not backends:
            errors.append(f"{srel}: Service {svc_name} selects no weightbridged --role=coordinator pod")
            continue
        for _, _, _, cc, cflags, cwhere in backends:
            target_port = resolve_port(cc, sp[0].get("targetPort", sp[0].get("port")))
            if target_port != port_of(cflags.get("listen")):
                errors.append(f"{srel}: Service {svc_name} port {port} targets {sp[0].get('targetPort')} = {target_port}, "
                              f"but the coordinator listens on {cflags.get('listen')}")
        if spec.get("hostNetwork") and spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
            errors.append(f"{where}: hostNetwork pods need dnsPolicy: ClusterFirstWithHostNet to resolve {target}")

    # The DaemonSet's host socket and the pods that use it.
    ds_socket_host = None
    ds_group = None
    for rel, d, spec, c, flags, where in daemons:
        if d["kind"] != "DaemonSet" or flags.get("role") != "node":
            continue
        if not spec.get("hostIPC"):
            errors.append(f"{where}: the node DaemonSet needs hostIPC: true (workers' shm and CUDA IPC)")
        if not spec.get("hostNetwork"):
            errors.append(f"{where}: the node DaemonSet needs hostNetwork: true (NCCL and the data plane use the node's NICs)")
        if not spec.get("hostPID"):
            errors.append(f"{where}: the node DaemonSet needs hostPID: true (workers in other pods have pid 0 in its own pid "
                          f"namespace: the daemon could neither tell them apart nor notice one killed)")
        sock = flags.get("worker_socket") or ""
        m = mount_for(c, sock)
        vol = [v for v in spec.get("volumes") or [] if m and v.get("name") == m.get("name")]
        if not vol or "hostPath" not in vol[0]:
            errors.append(f"{where}: --worker_socket {sock} must be on a hostPath volume so that worker pods reach it")
            continue
        ds_socket_host = os.path.join(vol[0]["hostPath"]["path"], os.path.relpath(sock, m["mountPath"]))
        ds_group = (spec.get("securityContext") or {}).get("runAsGroup")
        facts["k8s_socket"] = ds_socket_host
    worker_pods = 0
    for rel, d in docs:
        spec = pod_spec_of(d)
        if spec is None:
            continue
        sidecars = {}
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            if is_weightbridged(c):
                sidecars[c.get("name")] = c
        for c in spec.get("containers") or []:
            sock = next((e.get("value") for e in c.get("env") or [] if e.get("name") == SOCKET_ENV), None)
            if sock is None:
                continue
            worker_pods += 1
            where = f"{rel}: {d['kind']} {d['metadata']['name']} container {c.get('name')}"
            m = mount_for(c, sock)
            if not m:
                errors.append(f"{where}: {SOCKET_ENV}={sock} is not on a mounted volume")
                continue
            vol = next((v for v in spec.get("volumes") or [] if v.get("name") == m.get("name")), None)
            if vol is None:
                errors.append(f"{where}: volume {m.get('name')} is not defined")
                continue
            if "hostPath" in vol:
                host = os.path.join(vol["hostPath"]["path"], os.path.relpath(sock, m["mountPath"]))
                if ds_socket_host and host != ds_socket_host:
                    errors.append(f"{where}: {SOCKET_ENV}={sock} is {host} on the host, but the node DaemonSet's "
                                  f"socket is {ds_socket_host}")
                if not spec.get("hostIPC"):
                    errors.append(f"{where}: a pod using the node DaemonSet needs hostIPC: true (its buffers must be visible to the daemon)")
                groups = set((spec.get("securityContext") or {}).get("supplementalGroups") or [])
                groups.add((spec.get("securityContext") or {}).get("runAsGroup"))
                groups.add((c.get("securityContext") or {}).get("runAsGroup"))
                if ds_group is not None and ds_group not in groups:
                    errors.append(f"{where}: the socket is mode 0660 with group {ds_group}; add supplementalGroups: [{ds_group}]")
            else:
                # A sidecar daemon in the same pod must create the socket at the same path on the same volume.
                ok = False
                for name, sc in sidecars.items():
                    sflags = {}
                    for arg in (sc.get("command") or [])[1:] + (sc.get("args") or []):
                        n, v = split_flag(str(arg))
                        if n:
                            sflags[n] = v
                    ssock = sflags.get("worker_socket") or ""
                    sm = mount_for(sc, ssock)
                    if sm and sm.get("name") == m.get("name") and \
                            os.path.relpath(ssock, sm["mountPath"]) == os.path.relpath(sock, m["mountPath"]):
                        ok = True
                        if not spec.get("shareProcessNamespace"):
                            errors.append(f"{where}: a pod with a weightbridged sidecar needs shareProcessNamespace: true "
                                          f"(the daemon must see the engine's pids: SO_PEERCRED, kill -9 detection)")
                        shm_c, shm_s = mount_for(c, "/dev/shm/x"), mount_for(sc, "/dev/shm/x")
                        if not shm_c or not shm_s or shm_c.get("name") != shm_s.get("name"):
                            errors.append(f"{where}: engine and sidecar {name} must mount the same volume at /dev/shm "
                                          f"(shm buffers are files there)")
                if not ok:
                    errors.append(f"{where}: {SOCKET_ENV}={sock} (volume {m.get('name')}) is not where any weightbridged "
                                  f"in this pod creates its --worker_socket "
                                  f"({[ (n, (dict(split_flag(str(a)) for a in (s.get('args') or []))).get('worker_socket')) for n, s in sidecars.items()]})")
    if worker_pods == 0:
        errors.append(f"k8s/: no example pod sets {SOCKET_ENV} (the rollout examples are missing)")
    if ds_socket_host and facts.get("systemd_socket") and ds_socket_host != facts["systemd_socket"]:
        errors.append(f"socket paths differ: the DaemonSet's host socket is {ds_socket_host} but systemd/node.env "
                      f"has WB_WORKER_SOCKET={facts['systemd_socket']}")


# ----------------------------------------------------------------------------------------------------
# Containerfile


def check_containerfile(deploy_dir, errors):
    path = os.path.join(deploy_dir, "Containerfile")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        errors.append(f"Containerfile: {e}")
        return
    text_joined = re.sub(r"\\\n", " ", text)
    froms = re.findall(r"^FROM\s+(\S+)", text_joined, re.M)
    if len(froms) < 2:
        errors.append("Containerfile: expected a build stage and a runtime stage (two FROM lines)")
    if "debian:bookworm" not in text:
        errors.append("Containerfile: the build must be based on debian:bookworm")
    if not re.search(r"bazel\b.*\bbuild\b.*//daemon:weightbridged", text_joined):
        errors.append("Containerfile: does not bazel build //daemon:weightbridged")
    if BINARY_INSTALL_PATH not in text and "/usr/local/bin/" not in text:
        errors.append(f"Containerfile: does not install the daemon at {BINARY_INSTALL_PATH} (the path manifests run)")
    entry = re.search(r'^ENTRYPOINT\s+\[\s*"([^"]+)"', text_joined, re.M)
    if not entry or entry.group(1) != BINARY_INSTALL_PATH:
        errors.append(f"Containerfile: ENTRYPOINT must be [\"{BINARY_INSTALL_PATH}\"]")
    for helper in re.findall(r"\bdeploy/[A-Za-z0-9_./-]+", text_joined):
        if helper != "deploy/Containerfile" and not os.path.exists(os.path.join(deploy_dir, helper[len("deploy/"):])):
            errors.append(f"Containerfile: uses {helper}, which does not exist")


def check(deploy_dir, helpfull_text, binary=None):
    """All checks; returns a list of human-readable errors (empty when deploy/ is consistent)."""
    errors, facts = [], {}
    all_flags, daemon_flags = parse_helpfull(helpfull_text)
    if not daemon_flags:
        return ["could not read any weightbridged flag from its --helpfull output"]
    check_systemd(deploy_dir, all_flags, daemon_flags, errors, facts)
    if binary:
        verify_units_with_systemd(deploy_dir, binary, errors)
    check_k8s(deploy_dir, all_flags, daemon_flags, errors, facts)
    check_containerfile(deploy_dir, errors)
    return errors


def helpfull_of(binary):
    r = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    errors = check(argv[1], helpfull_of(argv[2]), argv[2])
    for e in errors:
        print("deploy_check: " + e)
    print(f"deploy_check: {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

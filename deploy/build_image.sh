#!/usr/bin/env bash
# Builds the WeightBridge image from deploy/Containerfile and smoke-tests it (docs/deploy.md,
# "Container image"). Not part of `make test`: the build stage is a full Bazel build (about 7 min on 2 cores).
#
#   deploy/build_image.sh [--engine podman|docker] [--tag NAME] [--base local|registry]
#                         [--worktree] [--no-smoke] [--smoke-only] [--prune] [--network MODE]
#                         [-- EXTRA_BUILD_ARGS...]
#
#   --engine     container engine (default: podman if installed, else docker)
#   --tag        image name (default localhost/weightbridged:latest)
#   --base       local (default): use localhost/debian:bookworm and localhost/debian:bookworm-slim,
#                creating them with debootstrap from $WB_DEBIAN_MIRROR (default
#                http://deb.debian.org/debian) when they are missing, so nothing is pulled from a
#                registry. registry: the Containerfile's defaults (debian:bookworm[-slim]).
#   --worktree   build context = the working tree as it is (filtered by Containerfile.dockerignore).
#                Default: a clean `git archive HEAD`, so uncommitted edits and build outputs stay out
#                and the image matches a commit (printed, and stored as a label).
#   --no-smoke   build only; --smoke-only: smoke-test an existing --tag without building.
#   --prune      after a successful build, delete dangling images, i.e. the build stage (~2.7 GB;
#                the next build then repeats `make deps` and the whole Bazel build).
#   --network    network for RUN steps (default host: apt-get needs the mirror).
#   Arguments after -- go to `<engine> build` unchanged (e.g. --build-arg BAZEL_FLAGS=).
#   WB_BUILD_NICE (default 10) is the nice level of the build; WB_ISOLATION, when set, is passed to
#   `podman build --isolation` (chroot where the sandbox cannot nest an OCI runtime); WB_CGROUPS,
#   when set, is passed to the smoke test's `podman run --cgroups` (e.g. disabled).
#
# Smoke test: `weightbridged --version`; the image user is 2000:2000 and processes run as it; a
# standalone daemon (host network, 127.0.0.1:0, --port_file and the worker socket in a mounted
# temp dir) answers `wbctl status` from the same image and exits 0 on SIGTERM; the image's default
# CMD with nothing mounted creates /run/weightbridge/worker.sock and exits 0 on SIGTERM.
#
# Exit codes: 0 built (and smoke test passed); 2 bad usage; 3 engine, debootstrap, git or root
# missing; 4 creating the local base images failed; 5 image build failed; 6 smoke test failed.
set -euo pipefail

die() { local code=$1; shift; echo "build_image: error: $*" >&2; exit "$code"; }
log() { echo "build_image: $*" >&2; }

ENGINE=""
TAG="localhost/weightbridged:latest"
BASE="local"
WORKTREE=0
SMOKE=1
BUILD=1
PRUNE=0
NETWORK="host"
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) [ $# -ge 2 ] || die 2 "--engine needs a value"; ENGINE=$2; shift 2 ;;
    --tag) [ $# -ge 2 ] || die 2 "--tag needs a value"; TAG=$2; shift 2 ;;
    --base) [ $# -ge 2 ] || die 2 "--base needs a value"; BASE=$2; shift 2 ;;
    --network) [ $# -ge 2 ] || die 2 "--network needs a value"; NETWORK=$2; shift 2 ;;
    --worktree) WORKTREE=1; shift ;;
    --no-smoke) SMOKE=0; shift ;;
    --smoke-only) BUILD=0; shift ;;
    --prune) PRUNE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die 2 "unknown argument '$1' (see --help)" ;;
  esac
done
case "$BASE" in local|registry) ;; *) die 2 "--base must be local or registry, not '$BASE'" ;; esac
if [ -z "$ENGINE" ]; then
  if command -v podman >/dev/null; then ENGINE=podman; else ENGINE=docker; fi
fi
case "$ENGINE" in podman|docker) ;; *) die 2 "--engine must be podman or docker, not '$ENGINE'" ;; esac
command -v "$ENGINE" >/dev/null || die 3 "$ENGINE is not installed (Debian: apt-get install podman)"
"$ENGINE" info >/dev/null 2>&1 || die 3 "'$ENGINE info' fails: is the engine usable by $(id -un)?"

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_IMAGE=localhost/debian:bookworm
RUN_IMAGE=localhost/debian:bookworm-slim
MIRROR=${WB_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SCRATCH=$(mktemp -d "${TMPDIR:-/var/tmp}/wb-image.XXXXXX")
SMOKE_NAME="wb-smoke-$$"
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  "$ENGINE" rm -f "$SMOKE_NAME" >/dev/null 2>&1 || true
  rm -rf "$SCRATCH"
}
trap cleanup EXIT

image_exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

# Imports a root filesystem directory as an image with a sane PATH and CMD, like the official ones.
import_rootfs() {  # DIR TAG
  tar --numeric-owner -C "$1" -c . | "$ENGINE" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$2" >/dev/null
}

# debian:bookworm and debian:bookworm-slim, made locally: a minbase debootstrap without apt caches,
# host files (resolv.conf, hostname) or, for -slim, documentation, man pages and translations
# (the same dpkg path excludes the official slim images use, so later installs stay slim too).
bootstrap_bases() {
  [ "$(id -u)" -eq 0 ] || die 3 "creating the base images needs root (debootstrap); or run with --base registry"
  command -v debootstrap >/dev/null || die 3 "debootstrap is not installed (apt-get install debootstrap)"
  local rootfs="$SCRATCH/rootfs"
  log "debootstrap bookworm (minbase) from $MIRROR into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$SCRATCH/debootstrap.log" 2>&1 \
    || { tail -20 "$SCRATCH/debootstrap.log" >&2; die 4 "debootstrap failed (log above)"; }
  echo "deb $MIRROR bookworm main" >"$rootfs/etc/apt/sources.list"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
  : >"$rootfs/etc/resolv.conf"; : >"$rootfs/etc/hostname"
  # As in the official images: apt leaves no .debs or package caches (~80 MB) in a layer, and
  # fetches no translations.
  cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF2'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF2
  echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
  if ! image_exists "$BUILD_IMAGE"; then
    import_rootfs "$rootfs" "$BUILD_IMAGE" || die 4 "importing $BUILD_IMAGE failed"
    log "created $BUILD_IMAGE"
  fi
  if ! image_exists "$RUN_IMAGE"; then
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
# Keep the image small: no documentation (but the copyright files), man pages or translations.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/en*
EOF
    find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,linda}/*
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'en*' -exec rm -rf {} +
    import_rootfs "$rootfs" "$RUN_IMAGE" || die 4 "importing $RUN_IMAGE failed"
    log "created $RUN_IMAGE"
  fi
  rm -rf "$rootfs"
}

build() {
  local args=(build -f deploy/Containerfile -t "$TAG" --network "$NETWORK")
  if [ "$BASE" = local ]; then
    if image_exists "$BUILD_IMAGE" && image_exists "$RUN_IMAGE"; then
      log "base images present: $BUILD_IMAGE, $RUN_IMAGE"
    else
      bootstrap_bases
    fi
    args+=(--build-arg "BUILD_IMAGE=$BUILD_IMAGE" --build-arg "RUN_IMAGE=$RUN_IMAGE")
    [ "$ENGINE" = podman ] && args+=(--pull=never)
  fi
  local context commit
  command -v git >/dev/null || die 3 "git is not installed"
  commit=$(git -C "$ROOT" rev-parse HEAD) || die 3 "$ROOT is not a git checkout"
  if [ "$WORKTREE" -eq 1 ]; then
    context=$ROOT
    [ -z "$(git -C "$ROOT" status --porcelain)" ] || commit="$commit-dirty"
    # podman/buildah of Debian 12 do not pick up <Containerfile>.dockerignore by themselves.
    [ "$ENGINE" = podman ] && args+=(--ignorefile "$ROOT/deploy/Containerfile.dockerignore")
  else
    context="$SCRATCH/context"
    mkdir -p "$context"
    git -C "$ROOT" archive HEAD | tar -x -C "$context"
    if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
      log "note: uncommitted changes are NOT in the image (building HEAD; --worktree to include them)"
    fi
  fi
  args+=(--label "org.opencontainers.image.revision=$commit")
  [ "$ENGINE" = podman ] && [ -n "${WB_ISOLATION:-}" ] && args+=(--isolation "$WB_ISOLATION")
  log "building $TAG from $commit ($ENGINE, context $context)"
  local t0=$SECONDS
  (cd "$context" && nice -n "${WB_BUILD_NICE:-10}" "$ENGINE" "${args[@]}" "${EXTRA[@]}" .) \
    || die 5 "$ENGINE build failed (output above)"
  log "built $TAG in $(( (SECONDS - t0) / 60 )) min $(( (SECONDS - t0) % 60 )) s"
  if [ "$PRUNE" -eq 1 ]; then
    "$ENGINE" image prune -f >/dev/null || log "warning: '$ENGINE image prune -f' failed"
    log "pruned dangling images (the build stage)"
  fi
}

smoke_fail() { "$ENGINE" logs "$SMOKE_NAME" >&2 2>&1 || true; die 6 "smoke test: $*"; }

smoke() {
  image_exists "$TAG" || die 6 "no image $TAG to smoke-test"
  local cg=()
  [ "$ENGINE" = podman ] && [ -n "${WB_CGROUPS:-}" ] && cg=(--cgroups "$WB_CGROUPS")
  local opts=(--network host "${cg[@]}")
  local run=(run --rm "${opts[@]}")

  local version
  version=$("$ENGINE" "${run[@]}" "$TAG" --version) || die 6 "weightbridged --version failed"
  log "smoke: weightbridged --version: $(echo "$version" | tr '\n' ' ')"

  local user ids
  user=$("$ENGINE" image inspect --format '{{.Config.User}}' "$TAG")
  [ "$user" = "2000:2000" ] || die 6 "image user is '$user', want 2000:2000"
  ids=$("$ENGINE" "${run[@]}" --entrypoint id "$TAG") || die 6 "id in the image failed"
  case "$ids" in "uid=2000(weightbridge) gid=2000(weightbridge)"*) ;;
    *) die 6 "processes run as '$ids', want uid=2000(weightbridge) gid=2000(weightbridge)" ;; esac
  log "smoke: runs as $ids"

  # A standalone daemon; the port is picked by the kernel and written to the mounted directory.
  local dir="$SCRATCH/run"
  mkdir -p "$dir" && chown 2000:2000 "$dir" && chmod 0750 "$dir"
  "$ENGINE" run -d --name "$SMOKE_NAME" "${opts[@]}" -v "$dir:/run/weightbridge" "$TAG" \
    --role=standalone --listen=127.0.0.1:0 --port_file=/run/weightbridge/port \
    --worker_socket=/run/weightbridge/worker.sock >/dev/null || smoke_fail "daemon did not start"
  local deadline=$((SECONDS + 30))
  until [ -s "$dir/port" ] && [ -S "$dir/worker.sock" ]; do
    [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$SMOKE_NAME")" = true ] \
      || smoke_fail "daemon exited before listening"
    [ $SECONDS -lt $deadline ] || smoke_fail "no port file and worker socket after 30 s"
    sleep 0.2
  done
  local port status
  port=$(cat "$dir/port")
  status=$("$ENGINE" "${run[@]}" --entrypoint wbctl "$TAG" status --addr "127.0.0.1:$port" --timeout 10s) \
    || smoke_fail "wbctl status --addr 127.0.0.1:$port failed: $status"
  log "smoke: wbctl status --addr 127.0.0.1:$port:"
  while IFS= read -r line; do echo "    $line" >&2; done <<<"$status"
  local sock_owner
  sock_owner=$(stat -c '%u:%g %a' "$dir/worker.sock")
  log "smoke: worker socket owner/mode on the host: $sock_owner"
  "$ENGINE" stop -t 10 "$SMOKE_NAME" >/dev/null || smoke_fail "stopping the daemon failed"
  local rc
  rc=$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$SMOKE_NAME")
  [ "$rc" = 0 ] || smoke_fail "daemon exited $rc on SIGTERM, want 0"
  "$ENGINE" rm "$SMOKE_NAME" >/dev/null
  log "smoke: daemon stopped cleanly (exit 0)"
  # The image's own CMD, nothing mounted (no network: it listens on 0.0.0.0:7070): the socket
  # directory must exist and be writable by uid 2000.
  "$ENGINE" run -d --name "$SMOKE_NAME" --network none "${cg[@]}" "$TAG" >/dev/null \
    || smoke_fail "the default CMD did not start"
  deadline=$((SECONDS + 30))
  until "$ENGINE" exec "$SMOKE_NAME" test -S /run/weightbridge/worker.sock 2>/dev/null; do
    [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$SMOKE_NAME")" = true ] \
      || smoke_fail "the default CMD exited before creating /run/weightbridge/worker.sock"
    [ $SECONDS -lt $deadline ] || smoke_fail "default CMD: no /run/weightbridge/worker.sock after 30 s"
    sleep 0.2
  done
  "$ENGINE" stop -t 10 "$SMOKE_NAME" >/dev/null || smoke_fail "stopping the default CMD failed"
  rc=$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$SMOKE_NAME")
  [ "$rc" = 0 ] || smoke_fail "default CMD exited $rc on SIGTERM, want 0"
  "$ENGINE" rm "$SMOKE_NAME" >/dev/null
  log "smoke: default CMD (no mounts) created its worker socket and stopped cleanly"
  log "smoke test passed; image $TAG: $("$ENGINE" image inspect --format '{{.Size}}' "$TAG") bytes"
}

[ "$BUILD" -eq 1 ] && build
[ "$SMOKE" -eq 1 ] && smoke
exit 0

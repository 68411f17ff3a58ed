#!/usr/bin/env bash
# Prints the Debian packages that own the shared libraries the given binaries link, one per line.
# Used by deploy/Containerfile to install exactly the runtime libraries in the final image. A library
# no package owns (e.g. CUDA under /usr/local/cuda) is named on stderr and makes it exit 1, so that an
# image never ships with a missing library unnoticed.
set -euo pipefail
missing=0
owners=()
for lib in $(ldd "$@" | awk '/=> \//{print $3}' | sort -u); do
  owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(readlink -f "$lib")" 2>/dev/null || true)
  if [ -z "$owner" ]; then
    echo "runtime_packages: no Debian package owns $lib" >&2
    missing=1
    continue
  fi
  owners+=("${owner%%:*}")
done
printf '%s\n' "${owners[@]}" | sort -u
exit "$missing"

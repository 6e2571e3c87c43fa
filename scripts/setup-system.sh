#!/usr/bin/env bash
# Installs the Debian tools the tests use, when missing (docker-compose for
# validating the compose file, iproute2 for the network-namespace tests, promtool
# from prometheus for checking the alert rules).
set -euo pipefail
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: missing ${need[*]} (install them; the tests that need them will be skipped)" >&2
  exit 0
fi
echo "setup: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || true
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || echo "setup: apt-get failed for ${need[*]}; dependent tests will skip" >&2

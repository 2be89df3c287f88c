#!/usr/bin/env bash
# Installs, with apt-get as root, each Debian package named on the command line whose command of the same name
# is missing (on PATH or in /usr/sbin). make test-image and make test-k8s run it before they need the tools.
set -euo pipefail
sbin="${HOST_TOOLS_SBIN:-/usr/sbin}"  # where Debian puts iptables; root's PATH has it, a user's may not
missing=()
for tool in "$@"; do
  command -v "$tool" >/dev/null || [ -x "$sbin/$tool" ] || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "missing on this host: ${missing[*]}; install them as root (Debian: apt-get install -y ${missing[*]})" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
for tool in "${missing[@]}"; do
  command -v "$tool" >/dev/null || [ -x "$sbin/$tool" ] || { echo "apt-get installed $tool, yet no $tool command" >&2; exit 1; }
done

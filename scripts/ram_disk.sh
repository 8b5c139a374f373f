#!/usr/bin/env bash
# A directory on a device faster than the software (memory), for finding the L3 path's own ceiling:
#   DIR=$(bash scripts/ram_disk.sh [SIZE_GIB])   then   --dir "$DIR" in benchmark/hicache/*.py
# tmpfs accepts O_DIRECT on Linux >= 6.6: then a private directory in /dev/shm is enough. Older kernels:
# ext4 on a loop file in /dev/shm, mounted at /mnt/sglang-cp-ram (needs root; SIZE_GIB, default 16).
# Remove it afterwards: rm -rf the directory (tmpfs), or umount /mnt/sglang-cp-ram and rm the image.
set -euo pipefail
size_gib=${1:-16}
dir=/dev/shm/sglang-cp-ram
mkdir -p -m 0700 "$dir"
if python3 - "$dir" <<'PY' 2>/dev/null
import os, sys
p = os.path.join(sys.argv[1], ".odirect-probe")
fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
os.close(fd)
os.unlink(p)
PY
then
  echo "$dir"
  exit 0
fi
rmdir "$dir" 2>/dev/null || true
[ "$(id -u)" = 0 ] || { echo "ram_disk.sh: tmpfs here refuses O_DIRECT (kernel < 6.6); the ext4-on-loop fallback needs root" >&2; exit 1; }
img=/dev/shm/sglang-cp-ram.img
mnt=/mnt/sglang-cp-ram
if ! mountpoint -q "$mnt"; then
  truncate -s "${size_gib}G" "$img"
  mkfs.ext4 -q -F "$img"
  mkdir -p "$mnt"
  mount -o loop "$img" "$mnt"
fi
mkdir -p -m 0700 "$mnt/l3"
echo "$mnt/l3"

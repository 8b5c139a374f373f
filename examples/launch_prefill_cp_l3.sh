#!/usr/bin/env bash
# Prefill server of a PD-disaggregated GLM-5 / DeepSeek-V3.2 deployment, one node of 8 GPUs:
# context-parallel prefill over 8 ranks (zigzag), KV cache sharded per CP rank, HiCache host
# pool (L2) of 100 GB per rank on hugepages, and sglang-cp's durable NVMe tier (L3) with the
# prefix cache reloaded after a restart. Only the prefill server gets --enable-cp-l3: it is
# where long shared prefixes are computed; the decode server (launch_decode.sh) receives KV
# over the transfer backend and keeps none of it durable.
#
# Check the machine first (O_DIRECT and free space per L3 disk, LMDB dir, hugetlbfs mount and
# how many 2 MiB hugepages the host pools need; exit 1 on a blocker):
#   sglang-cp doctor --cp-l3-config "$L3_CONFIG" --enable-cp-shared-physical-l2-hicache --hicache-size 100
# --hicache-size is GB (1e9 B) per rank: 8 ranks x 100 GB of KV host pool is about
# 8 x 100e9 / 2 MiB = 381,470 hugepages plus the DSA indexer pool (docs/sizing.md).
set -euo pipefail
MODEL=${MODEL:-/models/GLM-5}
L3_CONFIG=${L3_CONFIG:-examples/l3.single-nvme.toml}
HUGETLBFS=${HUGETLBFS:-/dev/hugepages}

exec python -m sglang.launch_server \
  --model-path "$MODEL" --trust-remote-code \
  --host 0.0.0.0 --port 30000 \
  --tp 8 --enable-prefill-cp --cp-strategy zigzag --attn-cp-size 8 \
  --enable-kv-cache-sharding --page-size 64 \
  --enable-hierarchical-cache --hicache-size 100 --hicache-mem-layout page_first \
  --hicache-write-policy write_through \
  --enable-cp-shared-physical-l2-hicache --cp-shared-l2-hugetlbfs-dir "$HUGETLBFS" \
  --enable-cp-l3 --cp-l3-config "$L3_CONFIG" --cp-l3-cold-start load \
  --disaggregation-mode prefill --disaggregation-transfer-backend mooncake \
  --disaggregation-bootstrap-port 8998 \
  --enable-metrics

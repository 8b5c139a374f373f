#!/usr/bin/env bash
# One GPU, any MLA model (DeepSeek-V2/V3/V3.2, GLM-5 class), with sglang-cp's durable NVMe tier
# (L3) under upstream's HiCache: the README's "minimal launch" line, verbatim.
#
#   MODEL=/models/DeepSeek-V2-Lite L3_CONFIG=l3.toml bash examples/launch_single_gpu_l3.sh
#
# L3_CONFIG: a copy of examples/l3.single-nvme.toml with your drive's paths (index.dir must
# exist) and capacity_gb. Check both first, on this machine or any other (no GPU needed):
#   sglang-cp doctor --cp-l3-config "$L3_CONFIG"
#   sglang-cp check-args -- <the arguments below>
# Arguments after the script's name are appended to the command line (e.g. --port 30001).
#
# What each flag is for: --page-size 64, the L3 page unit (64 tokens per slot);
# --enable-hierarchical-cache, upstream's host pool (L2), sized by upstream to fit host memory;
# --hicache-storage-prefetch-policy wait_complete, a request waits for its L3 prefetch (so a
# hit is a hit; upstream's default "timeout" may cut a slow prefetch short); --cp-l3-cold-start
# load, keep the pages already on disk across restarts; --enable-metrics, the sglang:cp_l3_*
# counters on /metrics.
set -euo pipefail
MODEL=${MODEL:-deepseek-ai/DeepSeek-V2-Lite}
L3_CONFIG=${L3_CONFIG:-l3.toml}

exec python -m sglang.launch_server \
  --model-path "$MODEL" --trust-remote-code --page-size 64 \
  --enable-hierarchical-cache --hicache-storage-prefetch-policy wait_complete \
  --enable-cp-l3 --cp-l3-config "$L3_CONFIG" --cp-l3-cold-start load \
  --enable-metrics --port 30000 "$@"

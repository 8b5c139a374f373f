#!/usr/bin/env bash
# Decode server of the PD-disaggregated deployment whose prefill server is
# launch_prefill_cp_l3.sh: no CP, no L3 (decode holds each request's KV only while it
# generates; durable prefix reuse belongs on the prefill side). Put a PD router in front of
# both, e.g. python -m sglang_router.launch_router --pd-disaggregation \
#   --prefill http://PREFILL_HOST:30000 8998 --decode http://DECODE_HOST:30001
set -euo pipefail
MODEL=${MODEL:-/models/GLM-5}

exec python -m sglang.launch_server \
  --model-path "$MODEL" --trust-remote-code \
  --host 0.0.0.0 --port 30001 \
  --tp 8 --page-size 64 \
  --disaggregation-mode decode --disaggregation-transfer-backend mooncake \
  --enable-metrics

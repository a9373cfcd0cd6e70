#!/usr/bin/env bash
# DeepSeek-V4-Flash, PD-disaggregated: the PREFILL instance (one 8xH200 node). It knows nothing of
# HiSparse: it runs prefill and ships each request's KV to the decode instance
# (dsv4_flash_pd_decode.sh), which with HiSparse lands the C4 pages in its pinned host pool.
#
# Runs:  python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash --tp-size 8
#        --attn-dp-size 8 --kv-cache-dtype fp8_e4m3 --dsv4-attn-backend flashmla
#        --disaggregation-mode prefill --disaggregation-bootstrap-port 8998
#        --disaggregation-transfer-backend mooncake ...
# Expect in the log: no "sglang-hisparse: HiSparse on" line; the bootstrap server listening on
#        port $BOOTSTRAP_PORT.
# Then:  start dsv4_flash_pd_decode.sh on the decode node and a PD router in front of both.
# Needs: the Mooncake transfer backend on both nodes (TRANSFER_BACKEND mooncake or mooncake_tcp;
#        see dsv4_flash_pd_decode.sh).
# Env:   MODEL_PATH PORT(30000) BOOTSTRAP_PORT(8998) TRANSFER_BACKEND IB_DEVICE CONTEXT_LENGTH EXTRA_ARGS
#        PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-V4-Flash}
PORT=${PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
transfer_args

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.8 --chunked-prefill-size 65536
    --kv-cache-dtype fp8_e4m3 --dsv4-attn-backend flashmla
    --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
    "${XFER_ARGS[@]}"
    --watchdog-timeout 3600
)
launch "${args[@]}"

#!/usr/bin/env bash
# GLM-5.1-FP8, PD-disaggregated: the PREFILL instance (one 8xH200 node). It knows nothing of
# HiSparse: it runs prefill and ships each request's KV to the decode instance
# (glm51_pd_decode.sh), which with HiSparse lands it straight in its pinned host pool.
#
# Runs:  python -m sglang.launch_server --model-path zai-org/GLM-5.1-FP8 --tp-size 8 --attn-dp-size 8
#        --disaggregation-mode prefill --disaggregation-bootstrap-port 8998
#        --disaggregation-transfer-backend mooncake ...
# Expect in the log: no "sglang-hisparse: HiSparse on" line (the plugin may register its hooks,
#        but without --enable-hisparse none of them is called); the bootstrap server listening on
#        port $BOOTSTRAP_PORT.
# Then:  start glm51_pd_decode.sh on the decode node and a PD router in front of both (README.md).
# Needs: a KV transfer backend both nodes can import, picked by TRANSFER_BACKEND (same on both):
#        mooncake (default, RDMA; not installed by sglang or sglang-hisparse:
#        pip install mooncake-transfer-engine, or mooncake-transfer-engine-cuda13 for torch on
#        CUDA 13), mooncake_tcp (the same package over TCP, no RDMA) or nixl (pip install nixl).
#        The script checks the import before launching; _common.sh lists SGLang's other choices.
# Env:   MODEL_PATH PORT(30000) BOOTSTRAP_PORT(8998) TRANSFER_BACKEND IB_DEVICE CONTEXT_LENGTH EXTRA_ARGS
#        PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-zai-org/GLM-5.1-FP8}
PORT=${PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
transfer_args

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.8 --chunked-prefill-size 65536
    --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
    "${XFER_ARGS[@]}"
    --watchdog-timeout 3600
)
launch "${args[@]}"

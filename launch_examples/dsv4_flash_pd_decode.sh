#!/usr/bin/env bash
# DeepSeek-V4-Flash, PD-disaggregated: the DECODE instance (one 8xH200 node) with HiSparse by sglang-hisparse.
#
# Runs:  python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash --tp-size 8
#        --attn-dp-size 8 --disaggregation-mode decode --kv-cache-dtype fp8_e4m3
#        --dsv4-attn-backend flashmla --disable-radix-cache --enable-hisparse
#        --hisparse-config '{"top_k": 512, ...}' --max-running-requests N
#        --disaggregation-decode-retraction-backup none --disaggregation-transfer-backend mooncake ...
# What changes with HiSparse: the prefill instance's C4 pages (the 21 C4 layers' compressed
#        entries, one per 4 tokens) are received into the pinned host pool, in the same FlashMLA
#        pages (docs/v4-m3.md D7); the C4 indexer keys, C128 entries and windows still go device
#        to device. A request then gets only its B+1 hot slots per C4 layer on the GPU.
# Expect in the log: "sglang-hisparse: HiSparse on for ... DeepSeek-V4 C4 layers' compressed
#        entries (...)", the host KV pool line, and the periodic "HiSparse: hit rate ..." line
#        whose "direct" count grows with every request received from prefill.
# A/B:   HISPARSE=off ./dsv4_flash_pd_decode.sh         full KV on the decode GPUs
#        ./ab_plugin_off.sh ./dsv4_flash_pd_decode.sh   SGLang's in-tree HiSparse, same command
# Needs: the Mooncake transfer backend on both nodes (TRANSFER_BACKEND mooncake, the default, or
#        mooncake_tcp): SGLang 0.5.23 sends V4's device-to-device part only over Mooncake, so
#        sglang-hisparse refuses another backend with DeepSeek-V4 at startup.
#        pip install mooncake-transfer-engine (or mooncake-transfer-engine-cuda13 for CUDA 13).
# Env:   MODEL_PATH PORT(30001) TRANSFER_BACKEND IB_DEVICE CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG
#        MAX_RUNNING_REQUESTS EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
RADIX_ARGS=(--disable-radix-cache)  # whatever RADIX says: V4 is served with the radix cache off

MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-V4-Flash}
PORT=${PORT:-30001}
hisparse_args DeepSeek-V4-Flash '{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 32}' 5392
case "$TRANSFER_BACKEND" in
    mooncake | mooncake_tcp) ;;
    *) echo "TRANSFER_BACKEND=$TRANSFER_BACKEND: DeepSeek-V4's PD transfer needs mooncake or mooncake_tcp" >&2; exit 2 ;;
esac
transfer_args
# sglang-hisparse refuses a PD decode server that would back KV up across retraction (docs/patches.md)
if [[ "$HISPARSE" == on ]]; then HS_ARGS+=(--disaggregation-decode-retraction-backup none); fi

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    --kv-cache-dtype fp8_e4m3 --dsv4-attn-backend flashmla
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --disaggregation-mode decode "${XFER_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"

#!/usr/bin/env bash
# DeepSeek-V3.2 on one 8xH200 node, prefill and decode co-located, HiSparse by sglang-hisparse.
#
# Runs:  python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3.2 --tp-size 8 --attn-dp-size 8
#        --kv-cache-dtype bfloat16 --dsa-decode-backend
#        flashmla_sparse --max-running-requests 232 --enable-hisparse
#        --hisparse-config '{...}' ...
# Sizing: `python -m sglang_hisparse plan --model DeepSeek-V3.2` (128K): about 232 concurrent
#        requests instead of 32 with full KV; host DRAM (2 TiB assumed) is what caps it, HBM
#        alone would allow ~248. For your node: PLAN="--host-dram-gib N" (the planner's flag).
# Expect in the log: the same "sglang-hisparse: ..." lines as glm51_colocated.sh (registered
#        hooks, HiSparse on for DeepSeek-V3.2, host KV pool) and the periodic "HiSparse: hit rate"
#        line once requests pass 4096 tokens.
# A/B:   HISPARSE=off ./dsv32_colocated.sh        full KV on the GPU
#        ./ab_plugin_off.sh ./dsv32_colocated.sh  SGLang's in-tree HiSparse
#        (61 layers, each with its own indexer: no prefetch groups, ab_prefetch_off.sh is a no-op.)
# Env:   MODEL_PATH PORT(30000) CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG MAX_RUNNING_REQUESTS
#        EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-V3.2}
PORT=${PORT:-30000}
hisparse_args DeepSeek-V3.2 '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 32}' 232

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    --kv-cache-dtype bfloat16 --dsa-decode-backend flashmla_sparse
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"

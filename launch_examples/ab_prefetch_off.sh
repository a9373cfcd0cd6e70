#!/usr/bin/env bash
# A/B: run a launch example with the shared-index prefetch turned off.
#
# Usage: ./ab_prefetch_off.sh glm52_colocated.sh [same env as that script]
#
# Sets SGLANG_HISPARSE_DISABLE_PREFETCH=1 (read by sglang-hisparse) and its in-tree name
# SGLANG_DISABLE_HISPARSE_PREFETCH=1 (read by SGLang's own HiSparse, and by us as a legacy
# alias), so the switch means the same in both arms of an ab_plugin_off.sh comparison.
#
# What changes: only models with index sharing (GLM-5.2: 57 of 78 layers reuse an anchor's
# top-k) have prefetch groups. With the switch, every shared layer resolves its own misses
# synchronously instead of replaying the anchor's miss plan on the prefetch stream. Outputs are
# identical; time per output token rises by roughly the link time of the shared layers that
# prefetch used to hide (`python -m sglang_hisparse plan --model GLM-5.2`: "link time per step"
# minus "on the critical path"). On GLM-5.1 and DeepSeek-V3.2 it changes nothing.
# Expect: the "HiSparse: hit rate" line's hit rate and GB moved unchanged between the arms.
set -euo pipefail
# The example is a path, or the name of one beside this wrapper (so any working directory works).
script=${1:-}
if [[ -n "$script" && ! -f "$script" ]]; then script="$(dirname "${BASH_SOURCE[0]}")/$script"; fi
if [[ ! -f "$script" ]]; then
    echo "usage: $0 <launch example>.sh   (e.g. $0 glm52_colocated.sh)" >&2
    exit 2
fi
export SGLANG_HISPARSE_DISABLE_PREFETCH=1
export SGLANG_DISABLE_HISPARSE_PREFETCH=1
shift
exec bash "$script" "$@"

#!/usr/bin/env bash
# A/B: run any launch example with the sglang-hisparse plugin NOT loaded.
#
# Usage: ./ab_plugin_off.sh glm51_colocated.sh [same env as that script]
#
# SGLang loads every installed `sglang.srt.plugins` entry point unless SGLANG_PLUGINS holds a
# comma-separated whitelist of entry-point names. An EMPTY value means "load all", so the
# plugin is excluded by naming only other plugins: this wrapper sets SGLANG_PLUGINS=none (a
# name no package registers, so no general plugin loads). Set SGLANG_PLUGINS yourself to a
# list without "hisparse" if you need other plugins. The whitelist also filters platform
# plugins; a stock CUDA install has none.
#
# What changes: nothing of ours is hooked, so the same --enable-hisparse --hisparse-config
# command runs SGLang 0.5.23's in-tree HiSparse: an implementation A/B with identical flags,
# except that the radix cache is off (RADIX=off: the in-tree implementation requires it; run
# the plugin's arm with RADIX=off too for a like-for-like pair).
# Expect: no "sglang-hisparse:" log lines, SGLang's "Skipping plugin hisparse (not in
# SGLANG_PLUGINS)" line instead, and no periodic "HiSparse: hit rate" line.
# For the full-KV baseline use HISPARSE=off instead.
set -euo pipefail
# The example is a path, or the name of one beside this wrapper (so any working directory works).
script=${1:-}
if [[ -n "$script" && ! -f "$script" ]]; then script="$(dirname "${BASH_SOURCE[0]}")/$script"; fi
if [[ ! -f "$script" ]]; then
    echo "usage: $0 <launch example>.sh   (e.g. $0 glm51_colocated.sh)" >&2
    exit 2
fi
export SGLANG_PLUGINS=${SGLANG_PLUGINS:-none}
# SGLang's in-tree HiSparse refuses the radix cache (validate_hisparse): the A/B runs without it.
export RADIX=off
if [[ ",${SGLANG_PLUGINS// /}," == *,hisparse,* ]]; then
    echo "SGLANG_PLUGINS=$SGLANG_PLUGINS still names hisparse; remove it (or unset it to get 'none')." >&2
    exit 2
fi
shift
exec bash "$script" "$@"

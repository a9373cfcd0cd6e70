"""SGLang plugin entry point: swaps SGLang's HiSparse seams for ours.

SGLang runs :func:`register` from ``sglang.srt.plugins.load_plugins()`` in the launcher and in
every scheduler process, before server arguments are parsed and before any pool or
coordinator is built (docs/patches.md has the full ledger). Importing this module does
nothing; :func:`register` is idempotent.

The first eight targets are REPLACEs: the in-tree object is swapped for ours, and SGLang's own
call sites (which only run under ``--enable-hisparse``) construct our classes. Without
``--enable-hisparse`` those are never called; the AROUND hooks (the KV budget,
``sglang_adapter.budget``; the radix-cache call paths, ``sglang_adapter.radix_hooks``) and the
AFTER hook on ``Scheduler.abort_request`` (``sglang_adapter.scheduler_hooks``) are, and find no
HiSparse allocator or coordinator and return SGLang's result unchanged. ``SGLANG_PLUGINS=<names without
hisparse>`` keeps this plugin from loading, which gives the in-tree HiSparse back for A/B.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass

from sglang_hisparse import SUPPORTED_SGLANG

logger = logging.getLogger(__name__)

ENTRY_POINT_NAME = "hisparse"


@dataclass(frozen=True)
class HookTarget:
    """One SGLang symbol we replace, and the object of ours that replaces it."""

    target: str  # dotted path in SGLang
    replacement: str  # "module:attr" in sglang_hisparse
    why: str
    hook: str = "REPLACE"  # HookType name: REPLACE, AROUND (ours gets the original) or AFTER


# NOTE: the classes are REPLACE targets rather than subclass-and-patch-the-call-site, because
# each is constructed in exactly one SGLang function behind a module-level or function-local
# import that HookRegistry rebinds; patching the (large, version-fragile) construction
# functions instead would couple us to far more SGLang code.
TARGETS: tuple[HookTarget, ...] = (
    HookTarget(
        "sglang.srt.arg_groups.hisparse_hook.validate_hisparse",
        "sglang_hisparse.sglang_adapter.arg_hook:validate_hisparse",
        "our validation of --enable-hisparse combinations and --hisparse-config",
    ),
    HookTarget(
        "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config",
        "sglang_hisparse.sglang_adapter.arg_hook:parse_hisparse_config",
        "pool sizing reads host_to_device_ratio through it; ours applies our config rules",
    ),
    HookTarget(
        "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator",
        "sglang_hisparse.sglang_adapter.coordinator:SGLangHiSparseCoordinator",
        "the coordinator ModelRunner builds: lifecycle, per-step protocol, resolve kernels",
    ),
    HookTarget(
        "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator",
        "sglang_hisparse.sglang_adapter.memory:HiSparseTokenAllocator",
        "the dual address space (logical ids <-> device rows) the configurator builds",
    ),
    HookTarget(
        "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool",
        "sglang_hisparse.sglang_adapter.memory:HiSparseDSAPool",
        "the DSA KV pool whose reads/writes translate logical ids to device rows",
    ),
    HookTarget(
        "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseMHAMainPool",
        "sglang_hisparse.sglang_adapter.memory_m3:HiSparseMHAPool",
        "MiniMax-M3's sparse-layer K/V at device rows (MiniMaxSparseKVPool imports it at call time)",
    ),
    HookTarget(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.HiSparseC4DevicePool",
        "sglang_hisparse.sglang_adapter.memory_v4:HiSparseC4Pool",
        "DeepSeek-V4's C4 entries at device rows in FlashMLA's pages, by compressed logical id",
    ),
    HookTarget(
        "sglang.srt.mem_cache.allocator.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator",
        "sglang_hisparse.sglang_adapter.memory_v4:HiSparseV4Allocator",
        "DeepSeek-V4's allocator: SGLang's SWA allocator + C4 entries by compressed id",
    ),
    HookTarget(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
        "sglang_hisparse.sglang_adapter.budget:reserve_coordinator_state",
        "the KV budget less the coordinator's per-request-slot GPU state, built after the pool",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.mem_cache.allocation.alloc_for_extend",
        "sglang_hisparse.sglang_adapter.radix_hooks:prepare_extend_prefixes",
        "radix cache: a matched prefix is held, and loaded from host where no device row holds it",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.mem_cache.common.release_kv_cache",
        "sglang_hisparse.sglang_adapter.radix_hooks:release_unstaged",
        "radix cache: a prefill released without request_finished stages what the tree keeps",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.mem_cache.prefill_budget.PrefillBudget._available_and_evictable",
        "sglang_hisparse.sglang_adapter.radix_hooks:available_rows_bound",
        "radix cache: evicting the tree frees logical ids, not device rows",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.mem_cache.prefill_budget.PrefillBudget.check_prefill",
        "sglang_hisparse.sglang_adapter.radix_hooks:admit_on_both_spaces",
        "admission: the prompt against device rows, prompt + max_new_tokens against logical ids",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req_ignore_eos",
        "sglang_hisparse.sglang_adapter.radix_hooks:admit_ignore_eos_on_both_spaces",
        "admission (ignore_eos): the prompt against device rows, the whole output against logical ids",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.managers.schedule_policy.PrefillAdder._request_slot_reserve_for_req",
        "sglang_hisparse.sglang_adapter.radix_hooks:reserve_prefix_rows",
        "radix cache: a matched prefix may need device rows to be loaded into",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
        "sglang_hisparse.sglang_adapter.radix_hooks:pd_prealloc_with_prefix",
        "PD decode radix cache: the prefix stays the tree's, only the suffix is transferred",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
        "sglang_hisparse.sglang_adapter.radix_hooks:allow_pd_decode_radix",
        "PD decode radix cache: SGLang refuses it with HiSparse inline",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets",
        "sglang_hisparse.sglang_adapter.radix_hooks:pd_budget_with_tree",
        "PD decode radix cache: the tree's evictable ids count toward admission (else it hangs)",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._radix_full_available",
        "sglang_hisparse.sglang_adapter.radix_hooks:pd_prealloc_evicts_logical",
        "PD decode radix cache: a prealloc evicts the tree for logical ids only, not for device rows",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
        "sglang_hisparse.sglang_adapter.radix_hooks:pd_rebind_after_checkpoint",
        "PD decode radix cache: host rows follow the ids the joining checkpoint repointed",
        hook="AROUND",
    ),
    HookTarget(
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        "sglang_hisparse.sglang_adapter.scheduler_hooks:abort_staging_requests",
        "SGLang's abort never looks in the staging queue; ours marks those requests too",
        hook="AFTER",
    ),
)

_registered = False


class UnsupportedSGLangError(RuntimeError):
    pass


def installed_sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def load_replacement(t: HookTarget):
    """Import and return our object that replaces ``t.target``."""
    module, attr = t.replacement.split(":")
    return getattr(importlib.import_module(module), attr)


def check_targets() -> list[tuple[HookTarget, str | None]]:
    """Resolve every target in the installed SGLang; (target, error or None) for each."""
    results = []
    for t in TARGETS:
        try:
            pkgutil.resolve_name(t.target)
            results.append((t, None))
        except Exception as e:  # ImportError, AttributeError, or an import-time failure
            results.append((t, f"{type(e).__name__}: {e}"))
    return results


def register() -> None:
    """Entry point of ``[project.entry-points."sglang.srt.plugins"] hisparse``.

    Registers one hook (``HookTarget.hook``) per :data:`TARGETS` entry; SGLang's ``load_plugins()`` applies
    them right after. Raises :class:`UnsupportedSGLangError` naming the installed and the
    supported SGLang when a target does not resolve (SGLang logs it and keeps its in-tree
    HiSparse).
    """
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = [(t, err) for t, err in check_targets() if err]
    if missing:
        lines = "\n".join(f"  {t.target}: {err}" for t, err in missing)
        raise UnsupportedSGLangError(
            f"sglang-hisparse supports SGLang {SUPPORTED_SGLANG}, but the installed SGLang is "
            f"{installed_sglang_version()} and these hook targets do not resolve:\n{lines}\n"
            f"Install sglang=={SUPPORTED_SGLANG}, or set SGLANG_PLUGINS to a list without "
            f"'{ENTRY_POINT_NAME}' to run SGLang's in-tree HiSparse."
        )
    # Import every replacement before registering any, so a broken install registers nothing
    # instead of a half-replaced HiSparse.
    replacements = [(t, load_replacement(t)) for t in TARGETS]
    for t, obj in replacements:
        HookRegistry.register(t.target, obj, HookType[t.hook])
    _registered = True
    logger.info(
        "sglang-hisparse: registered %d hooks for SGLang %s (in-tree HiSparse replaced; "
        "set SGLANG_PLUGINS without '%s' to use the in-tree one).",
        len(TARGETS),
        installed_sglang_version(),
        ENTRY_POINT_NAME,
    )


def is_ours(obj: object, ours: object) -> bool:
    """``obj`` is ``ours``, or HookRegistry's REPLACE or AROUND wrapper around it.

    NOTE: HookRegistry substitutes replacement classes directly but wraps hook functions in a
    ``functools.wraps(original)`` closure that calls ours; the closure cell is the only link
    back to our function.
    """
    if obj is ours:
        return True
    return any(getattr(c, "cell_contents", None) is ours for c in (getattr(obj, "__closure__", None) or ()))


def applied() -> dict[str, bool]:
    """For each target: does SGLang's name now resolve to our replacement? (doctor, tests)"""
    out = {}
    for t in TARGETS:
        try:
            out[t.target] = is_ours(pkgutil.resolve_name(t.target), load_replacement(t))
        except Exception:
            out[t.target] = False
    return out

"""``python -m sglang_hisparse doctor``: is this machine ready to serve with our HiSparse?

Checks, each reported as ok / warn / FAIL with the reason and the fix:
SGLang installed and supported; our entry point discoverable and allowed by SGLANG_PLUGINS;
every hook target and every replacement of ours present; apache-tvm-ffi, what the kernels' JIT
build needs (CUDA home, nvcc, libcudart, ninja, a C++ compiler) and a GPU; the Mooncake transfer
engine PD decode over ``--disaggregation-transfer-backend mooncake`` needs (importable, its
transports, RDMA devices); the effective environment switches; and, given ``--hisparse-config``, the effective config or its exact
error. Exits 1 when any check FAILs (a missing GPU or an incomplete kernel toolchain is a
warning unless ``--require-gpu``).

The hook check reads SGLang's sources (milliseconds) instead of importing SGLang (~20 s and a
screen of platform warnings); ``--import-hooks`` imports as a server does, to catch
import-time failures too, and summarises SGLang's import warnings in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sglang_hisparse import SUPPORTED_SGLANG, __version__, envs

if TYPE_CHECKING:
    from sglang_hisparse.plugin import HookTarget

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "doctor",
        help="check SGLang, the plugin hooks, tvm-ffi, the kernel toolchain, the GPU and a --hisparse-config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hisparse-config", metavar="JSON", help="validate this --hisparse-config and print the effective values")
    p.add_argument("--model-config", metavar="PATH", help="a model config.json (or its directory): its index_topk is the top-k used")
    p.add_argument("--require-gpu", action="store_true", help="treat a missing CUDA GPU or an incomplete kernel toolchain as a failure (use on serving hosts)")
    hooks = p.add_mutually_exclusive_group()
    hooks.add_argument("--skip-hooks", action="store_true", help="do not check the hook targets at all")
    hooks.add_argument("--import-hooks", action="store_true",
                       help="import SGLang and our replacements as a server does (~20 s) instead of reading their "
                            "sources: also catches import-time failures")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def _sglang_version() -> str | None:
    from sglang_hisparse.plugin import installed_sglang_version

    return installed_sglang_version()


def check_sglang() -> Check:
    v = _sglang_version()
    if v is None:
        return Check("sglang", FAIL, f"not installed; pip install sglang=={SUPPORTED_SGLANG}")
    if v != SUPPORTED_SGLANG:
        return Check("sglang", FAIL, f"installed {v}, supported {SUPPORTED_SGLANG}; pip install sglang=={SUPPORTED_SGLANG}")
    return Check("sglang", OK, f"{v} (supported: {SUPPORTED_SGLANG})")


def check_entry_point() -> Check:
    from importlib.metadata import entry_points

    from sglang_hisparse.plugin import ENTRY_POINT_NAME

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == ENTRY_POINT_NAME]
    if not eps:
        return Check("entry point", FAIL, "sglang.srt.plugins:hisparse not found; reinstall from the clone: "
                     "pip install -e . (or pip install dist/sglang_hisparse-*.whl); not on PyPI yet")
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in allowed.split(",") if x.strip()}
    if names and ENTRY_POINT_NAME not in names:
        return Check(
            "entry point",
            WARN,
            f"{eps[0].value} is installed but SGLANG_PLUGINS={allowed!r} excludes it: SGLang's in-tree HiSparse will run",
        )
    return Check("entry point", OK, f"hisparse -> {eps[0].value}")


def _hook_name(t: HookTarget) -> str:
    return f"hook {t.target.rsplit('.', 1)[-1]}"


def check_hooks() -> list[Check]:
    """Every hook target in SGLang's sources and every replacement in ours, read, not imported.

    A name the source reading cannot confirm (made at run time, inherited) is resolved by
    importing it before it is called missing, so this is never stricter than the import.
    """
    from sglang_hisparse.cli.source_names import find
    from sglang_hisparse.plugin import TARGETS

    out = []
    for t in TARGETS:
        missing = find(t.target)
        if missing is None:
            missing = find(t.replacement)
            if missing is not None:
                missing = f"our {t.replacement} is not there: {missing}"
        if missing is not None:
            imported, _ = _import_hooks([t])
            out.append(imported[0] if imported[0].status == OK else Check(_hook_name(t), FAIL, missing))
            continue
        out.append(Check(_hook_name(t), OK, f"{t.target} -> {t.hook} by {t.replacement}"))
    return out


def _import_hooks(targets: Sequence[HookTarget]) -> tuple[list[Check], list[warnings.WarningMessage]]:
    """Resolve ``targets`` in SGLang and load our replacements by importing them; the warnings
    the imports raise are returned, not printed."""
    import pkgutil

    from sglang_hisparse.plugin import load_replacement

    out = []
    # NOTE: the filters stay as they are, so what is recorded is what Python would have printed
    # (not the SWIG and cutlass DeprecationWarnings that "always" would add).
    with warnings.catch_warnings(record=True) as caught:
        for t in targets:
            try:
                pkgutil.resolve_name(t.target)
            except Exception as e:  # ImportError, AttributeError, or an import-time failure
                out.append(Check(_hook_name(t), FAIL, f"{t.target} does not resolve in this SGLang: {type(e).__name__}: {e}"))
                continue
            try:
                load_replacement(t)
            except Exception as e:
                out.append(Check(_hook_name(t), FAIL, f"our {t.replacement} does not load: {type(e).__name__}: {e}"))
                continue
            out.append(Check(_hook_name(t), OK, f"{t.target} -> {t.hook} by {t.replacement} (imported)"))
    return out, list(caught)


def summarise_warnings(caught: list[warnings.WarningMessage], seconds: float, cuda: bool) -> Check:
    """One line for the warnings importing SGLang raised: count, then each distinct message's
    first line with the module that raised it. Without a CUDA device SGLang's platform
    warnings (AWQ, GGUF, Triton "not supported") are expected, so they only warn with one."""
    distinct: dict[str, str] = {}
    for w in caught:
        module = w.filename.strip("<>") if w.filename.startswith("<") else os.path.splitext(os.path.basename(w.filename))[0]
        distinct.setdefault(str(w.message).splitlines()[0].strip(), module)
    if not distinct:
        return Check("sglang import", OK, f"{seconds:.1f} s, no warnings")
    listed = "; ".join(f"{module}: {msg}" for msg, module in distinct.items())
    status = WARN if cuda else OK
    note = "" if cuda else " (expected without a CUDA device)"
    return Check("sglang import", status, f"{seconds:.1f} s, {len(caught)} warning(s){note}: {listed}")


def check_tvm_ffi() -> Check:
    try:
        from importlib.metadata import version

        import tvm_ffi  # noqa: F401

        return Check("apache-tvm-ffi", OK, version("apache-tvm-ffi"))
    except Exception as e:
        return Check("apache-tvm-ffi", FAIL, f"not importable ({e}); pip install apache-tvm-ffi==0.1.11")


def check_kernel_build(require: bool, torch_cuda: str | None) -> Check:
    """What the kernels' JIT build needs (``kernels/toolchain.py``): a problem FAILs with
    ``--require-gpu`` (serving hosts build at first use), else warns."""
    from sglang_hisparse.kernels.toolchain import inspect

    r = inspect(torch_cuda=torch_cuda)
    nvcc = f"{r.home}/bin/nvcc, CUDA {r.nvcc_release}" if r.nvcc_release else "no nvcc"
    if r.ok:
        return Check("kernel build", OK, f"CUDA home {r.home} (from {r.home_from}): {nvcc}, libcudart, ninja, c++")
    return Check("kernel build", FAIL if require else WARN,
                 f"python -m sglang_hisparse.kernels would fail: {r.summary()}")


def check_gpu(require: bool) -> Check:
    with warnings.catch_warnings(record=True) as caught:  # e.g. a driver too old for torch's CUDA
        try:
            import torch
        except Exception as e:
            return Check("gpu", FAIL, f"torch not importable: {e}")
        available = torch.cuda.is_available()
    said = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
    if not available:
        status = FAIL if require else WARN
        why = f" ({said})" if said else ""
        return Check("gpu", status, f"no CUDA device{why}: serving needs one; plan/simulate/doctor work without")
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    status = OK if major >= 9 else WARN
    note = "" if major >= 9 else " (kernels are built and measured for sm_90; older GPUs are untested)"
    return Check("gpu", status, f"{torch.cuda.device_count()} x {name}, sm_{major}{minor}{note}")


def _torch_cuda() -> tuple[str | None, bool]:
    """torch's CUDA version and whether a device is usable, once ``check_gpu`` imported it."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None, False
    return torch.version.cuda, bool(torch.cuda.is_available())


def _model_top_k(path: str | None) -> int | None:
    if not path:
        return None
    from sglang_hisparse.cli.inputs import model_config_path, read_model_config

    p = model_config_path(path)
    cfg = read_model_config(path)
    top_k = cfg.get("index_topk") or (cfg.get("text_config") or {}).get("index_topk")
    if top_k is None:
        raise ValueError(f"--model-config {p}: no 'index_topk' (not a DSA model)")
    return int(top_k)


def check_config(text: str | None, model_config: str | None) -> Check:
    from sglang_hisparse.config import HiSparseConfig

    try:
        cfg = HiSparseConfig.from_json(text, model_top_k=_model_top_k(model_config))
    except (ValueError, OSError) as e:
        return Check("hisparse-config", FAIL, str(e))
    return Check("hisparse-config", OK, f"effective: {cfg.to_json()}")


#: the wheels SGLang's Mooncake PD backend runs on (GPU build, CPU-only build)
MOONCAKE_WHEELS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
#: ``mooncake.engine``'s build flags -> the transport each adds; tcp and rdma are in every
#: build (the engine links libibverbs.so.1 even for TCP)
MOONCAKE_FLAGS = {"SUPPORT_CUDA": "cuda", "SUPPORT_INTRA_NVLINK": "nvlink", "SUPPORT_MNNVL": "mnnvl",
                  "SUPPORT_EFA": "efa", "SUPPORT_HIP": "hip", "SUPPORT_MUSA": "musa"}


def check_mooncake(rdma_dir: str = "/sys/class/infiniband") -> Check:
    """Whether ``mooncake.engine`` imports (~0.1 s, no SGLang), which transports it offers,
    and which RDMA devices exist (none: SGLang's backend needs ``MOONCAKE_PROTOCOL=tcp``). A
    warning, not a failure, when absent: only a PD instance over Mooncake needs it."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        engine = importlib.import_module("mooncake.engine")
    except ImportError as e:  # the wheel, or a library it links, is absent
        return Check("mooncake", WARN, f"mooncake.engine not importable ({e}): PD over "
                     "--disaggregation-transfer-backend mooncake needs pip install mooncake-transfer-engine "
                     "(GPU) or mooncake-transfer-engine-non-cuda, and libibverbs1 (linked even for TCP); "
                     "colocated serving does not")
    wheels = []
    for wheel in MOONCAKE_WHEELS:
        try:
            wheels.append(f"{wheel} {version(wheel)}")
        except PackageNotFoundError:
            pass
    transports = ["tcp", "rdma", *(t for flag, t in MOONCAKE_FLAGS.items() if getattr(engine, flag, False))]
    devices = sorted(os.listdir(rdma_dir)) if os.path.isdir(rdma_dir) else []
    return Check("mooncake", OK, f"{', '.join(wheels) or 'mooncake.engine'}: transports {', '.join(transports)}; "
                 f"RDMA devices: {', '.join(devices) or 'none (PD over it: MOONCAKE_PROTOCOL=tcp)'}")


def check_envs() -> Check:
    parts = []
    for name in envs.registry():
        src = envs.source(name)
        try:
            value = envs.get(name)
        except ValueError as e:
            return Check("environment", FAIL, str(e))
        if src is not None:
            via = "" if src == name else f" (via legacy {src})"
            parts.append(f"{name}={value!r}{via}")
    return Check("environment", OK, ", ".join(parts) if parts else "all defaults")


def run(args: argparse.Namespace) -> int:
    checks = [Check("sglang-hisparse", OK, __version__), check_sglang(), check_entry_point()]
    caught, import_s = None, 0.0
    if not args.skip_hooks and checks[1].status == OK:
        if args.import_hooks:
            from sglang_hisparse.plugin import TARGETS

            t0 = time.perf_counter()
            hooks, caught = _import_hooks(TARGETS)
            import_s = time.perf_counter() - t0
            checks += hooks
        else:
            checks += check_hooks()
    gpu = check_gpu(args.require_gpu)
    torch_cuda, cuda = _torch_cuda()
    if caught is not None:
        checks.append(summarise_warnings(caught, import_s, cuda=cuda))
    checks += [check_tvm_ffi(), check_kernel_build(args.require_gpu, torch_cuda), gpu, check_mooncake(),
               check_envs()]
    if args.hisparse_config is not None or args.model_config:
        checks.append(check_config(args.hisparse_config, args.model_config))
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<{width}}  {c.detail}")
        print()
        print(f"{len(failed)} problem(s) found." if failed else "All checks passed.")
    return 1 if failed else 0

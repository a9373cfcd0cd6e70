"""``python -m sglang_hisparse doctor``: is this machine ready to serve with our HiSparse?

Checks, each reported as ok / warn / FAIL with the reason and the fix:
SGLang installed and supported; our entry point discoverable and allowed by SGLANG_PLUGINS;
every hook target resolvable; apache-tvm-ffi, nvcc and a GPU for the kernels; the effective
environment switches; and, given ``--hisparse-config``, the effective config or its exact
error. Exits 1 when any check FAILs (a missing GPU is a warning unless ``--require-gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

from sglang_hisparse import SUPPORTED_SGLANG, __version__, envs

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "doctor",
        help="check SGLang, the plugin hooks, tvm-ffi/nvcc/GPU, and a --hisparse-config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hisparse-config", metavar="JSON", help="validate this --hisparse-config and print the effective values")
    p.add_argument("--model-config", metavar="PATH", help="a model config.json (or its directory): its index_topk is the top-k used")
    p.add_argument("--require-gpu", action="store_true", help="treat a missing CUDA GPU as a failure (use on serving hosts)")
    p.add_argument("--skip-hooks", action="store_true", help="do not import SGLang to resolve hook targets (faster; less thorough)")
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


def check_hooks() -> list[Check]:
    from sglang_hisparse.plugin import check_targets, load_replacement

    out = []
    for t, err in check_targets():
        name = f"hook {t.target.rsplit('.', 1)[-1]}"
        if err:
            out.append(Check(name, FAIL, f"{t.target} does not resolve in this SGLang: {err}"))
            continue
        try:
            load_replacement(t)
        except Exception as e:
            out.append(Check(name, FAIL, f"our {t.replacement} does not load: {type(e).__name__}: {e}"))
            continue
        out.append(Check(name, OK, f"{t.target} -> {t.hook} by {t.replacement}"))
    return out


def check_tvm_ffi() -> Check:
    try:
        from importlib.metadata import version

        import tvm_ffi  # noqa: F401

        return Check("apache-tvm-ffi", OK, version("apache-tvm-ffi"))
    except Exception as e:
        return Check("apache-tvm-ffi", FAIL, f"not importable ({e}); pip install apache-tvm-ffi==0.1.11")


def check_nvcc() -> Check:
    candidates = [shutil.which("nvcc")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and os.path.exists(c):
            try:
                out = subprocess.run([c, "--version"], capture_output=True, text=True, timeout=20).stdout
                release = next((line.strip() for line in out.splitlines() if "release" in line), out.strip()[-60:])
            except Exception as e:
                release = f"found but not runnable: {e}"
            return Check("nvcc", OK, f"{c}: {release}")
    return Check("nvcc", WARN, "not found (kernels compile at first use; set CUDA_HOME on serving hosts)")


def check_gpu(require: bool) -> Check:
    try:
        import torch
    except Exception as e:
        return Check("gpu", FAIL, f"torch not importable: {e}")
    if not torch.cuda.is_available():
        status = FAIL if require else WARN
        return Check("gpu", status, "no CUDA device: serving needs one; plan/simulate/doctor work without")
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    status = OK if major >= 9 else WARN
    note = "" if major >= 9 else " (kernels are built and measured for sm_90; older GPUs are untested)"
    return Check("gpu", status, f"{torch.cuda.device_count()} x {name}, sm_{major}{minor}{note}")


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
    if not args.skip_hooks and checks[1].status == OK:
        checks += check_hooks()
    checks += [check_tvm_ffi(), check_nvcc(), check_gpu(args.require_gpu), check_envs()]
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

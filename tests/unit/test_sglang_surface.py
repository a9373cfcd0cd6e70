"""Every hook target and every SGLang attribute path we read exists in the installed SGLang.

A ``getattr(obj, "name", default)`` of a name SGLang does not have returns the default in
silence (``getattr(req, "req_pool_idx", None)`` was None for every request in 0.5.23); these
tests name each missing path instead. The paths are ``sglang_hisparse.sglang_surface``'s
tables, checked against a real ``Req``, the real argument pipeline on a config-only model,
SGLang's published namespaces and the classes' own sources.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from sglang_hisparse import sglang_surface as surface

pytestmark = pytest.mark.usefixtures("sglang_with_plugin")

#: the checkout the tests run from (``SCANNED`` reaches the rig in ``hisparse_testing/``)
REPO = Path(surface.__file__).resolve().parents[1]


def test_every_hook_target_resolves_to_a_class_or_callable():
    from sglang_hisparse.plugin import TARGETS

    bad = []
    for t in TARGETS:
        try:
            obj = pkgutil.resolve_name(t.target)
        except Exception as e:  # ImportError, AttributeError
            bad.append(f"{t.target}: {type(e).__name__}: {e}")
            continue
        if not (inspect.isclass(obj) or callable(obj)):
            bad.append(f"{t.target}: resolves to {type(obj).__name__}, not a class or callable")
    assert not bad, "hook targets missing in the installed SGLang:\n" + "\n".join(bad)


def _path_exists(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@pytest.fixture(scope="module")
def real_req():
    """A ``Req`` as the scheduler builds one from a tokenized request (no published config needed)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req("surface-0", "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4))


def test_req_paths_exist_on_a_real_req(real_req):
    missing = [f"Req.{path} ({who})" for path, who in surface.REQ if not _path_exists(real_req, path)]
    assert not missing, "paths our adapter reads that a 0.5.23 Req does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("name, where", surface.NOT_ON_REQ)
def test_req_keeps_kv_state_in_its_kv_info_not_on_itself(real_req, name, where):
    """Why ``getattr(req, "req_pool_idx", None)`` was wrong: 0.5.23 moved the slot (and the
    tree-owned prefix) into ``Req.kv`` (``ReqKvInfo``), so the old read was always None."""
    assert not hasattr(real_req, name), f"Req.{name} exists again; {where} is where 0.5.23 keeps it"
    assert _path_exists(real_req, where)


def test_schedule_batch_fields():
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    fields = {f.name for f in dataclasses.fields(ScheduleBatch)}
    missing = [f"ScheduleBatch.{name} ({who})" for name, who in surface.SCHEDULE_BATCH if name not in fields]
    assert not missing, "ScheduleBatch fields we read that 0.5.23 does not have:\n" + "\n".join(missing)


def _pipeline(model_dir):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
                                "--enable-hisparse", "--disable-radix-cache"])
    args.resolve_once()
    args.check_server_args()
    return args


def test_server_args_fields_exist_after_resolution(dsa_model_dir):
    """The views of SGLang's resolved arguments raise AttributeError for a name they do not
    have, so ``getattr(view, name, default)`` of a missing one would silently be the default."""
    from sglang.srt.arg_groups.model_override_base import resolved_view, resolving_view

    args = _pipeline(dsa_model_dir)
    missing = []
    for label, obj in (("ServerArgs", args), ("resolving_view", resolving_view(args)),
                       ("resolved_view", resolved_view(args))):
        missing += [f"{label}.{name} ({who})" for name, who in surface.SERVER_ARGS if not hasattr(obj, name)]
    assert not missing, "server-argument fields we read that 0.5.23 does not have:\n" + "\n".join(missing)


def test_model_config_attributes_on_a_real_model_config(dsa_model_dir):
    from sglang.srt.arg_groups.model_override_base import model_config_of

    model_config = model_config_of(_pipeline(dsa_model_dir))
    missing = [f"ModelConfig.{name} ({who})" for name, who in surface.MODEL_CONFIG if not hasattr(model_config, name)]
    assert not missing, "ModelConfig attributes we read that 0.5.23 does not have:\n" + "\n".join(missing)


def test_published_leaves_are_in_their_namespaces():
    """``get_memory().disable_radix_cache`` and the like: each leaf is projected into the
    namespace we read it from (``runtime_context._build_config_bags`` uses ``namespace_of``)."""
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.server_args import ServerArgs

    where = namespace_of(ServerArgs)
    wrong = [f"get_{ns}().{leaf} ({who}): SGLang puts it in {where.get(leaf)!r}"
             for ns, leaf, who in surface.PUBLISHED if where.get(leaf, "").split(".")[0] != ns]
    assert not wrong, "published leaves we read from the wrong (or no) namespace:\n" + "\n".join(wrong)


@functools.cache
def _self_attrs(cls: type) -> frozenset[str]:
    """Names assigned on ``self`` anywhere in ``cls``'s own source (``self.x = ...``,
    ``object.__setattr__(self, "x", ...)``), and its class-level annotations."""
    names = set(vars(cls).get("__annotations__", {}))
    try:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return frozenset(names)


def defines(cls: type, name: str) -> bool:
    """``name`` is a class attribute, method, property, dataclass or msgspec field of ``cls``,
    or assigned on ``self`` in the source of ``cls`` or one of its bases."""
    if hasattr(cls, name) or name in getattr(cls, "__struct_fields__", ()):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return any(name in _self_attrs(base) for base in cls.__mro__ if base is not object)


def test_class_attributes_exist():
    missing = []
    for owner, name, who in surface.CLASS_ATTRS:
        try:
            cls = pkgutil.resolve_name(owner)
        except Exception as e:
            missing.append(f"{owner}: {type(e).__name__}: {e}")
            continue
        if not defines(cls, name):
            missing.append(f"{owner}.{name} ({who})")
    assert not missing, "SGLang attributes we read that 0.5.23 does not define:\n" + "\n".join(missing)


def test_the_class_check_tells_a_missing_attribute():
    """The check above can fail: a name no class defines is reported missing."""
    from sglang.srt.managers.schedule_batch import Req

    assert defines(Req, "kv") and defines(Req, "prefix_len")
    assert not defines(Req, "req_pool_idx")


_READ = re.compile(r"\b(?:getattr|hasattr)\(\s*[^,()]+(?:\([^()]*\))?(?:\.[A-Za-z_]\w*)*\s*,\s*[\"']([A-Za-z_]\w*)[\"']")


def test_every_literal_getattr_name_of_the_adapter_is_listed():
    """A new ``getattr(obj, "name", default)`` in the adapter or the rig must be in
    ``sglang_surface``'s tables (checked above) or in its ``OURS`` (our own attributes)."""
    listed = surface.listed_names()
    unlisted = []
    scanned = [path for pattern in surface.SCANNED for path in sorted(REPO.glob(pattern))]
    assert any(p.parent.name == "hisparse_testing" for p in scanned), "no rig file was scanned"
    for path in scanned:
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            unlisted += [f"{path.relative_to(REPO)}:{lineno}: {name}"
                         for name in _READ.findall(line) if name not in listed]
    assert not unlisted, "getattr/hasattr names not in sglang_surface (add them where they belong):\n" + "\n".join(unlisted)

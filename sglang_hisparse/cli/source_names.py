"""Does a dotted name exist in an installed package's source? Answered without importing it.

``doctor`` checks every hook target (``sglang.srt.managers.scheduler.Scheduler.abort_request``)
and every replacement of ours. Importing them, as ``plugin.check_targets`` does, loads torch,
triton, flashinfer and most of SGLang: ~20 s on an idle host, with platform warnings on stderr.
Reading the module's file and finding the name among its top-level statements (or a class
body's) takes milliseconds. It cannot see names made at run time (``globals()[...] =``, module
``__getattr__``) nor methods a class inherits; for those :func:`find` says where it stopped,
and ``doctor --import-hooks`` imports for real.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def module_file(parts: list[str]) -> tuple[Path | None, int] | None:
    """The source file of the longest importable prefix of ``parts``, and that prefix's length;
    None when the top-level package is not installed.

    Only the top-level package is looked up (``find_spec`` of a dotted name would import its
    parents); below it the folders are walked in the import system's order: a package's
    ``__init__.py``, then a module, then a namespace folder. The file is None when the prefix
    ends at a namespace folder (SGLang's ``srt/`` has no ``__init__.py``): no source to read.
    """
    spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return (Path(spec.origin) if spec.origin else None), 1
    folder = Path(next(iter(spec.submodule_search_locations)))
    best: tuple[Path | None, int] = ((folder / "__init__.py") if (folder / "__init__.py").is_file() else None, 1)
    for i, part in enumerate(parts[1:], start=2):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
            best = (folder / "__init__.py", i)
        elif (folder / f"{part}.py").is_file():
            return folder / f"{part}.py", i
        elif (folder / part).is_dir():
            folder = folder / part
            best = (None, i)
        else:
            break
    return best


def _defines(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of ``body`` that binds ``name``: def, class, assignment or import."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return node
        if isinstance(node, (ast.If, ast.Try)):  # `try: from x import y` / `if TYPE_CHECKING:`
            blocks = [node.body, node.orelse] + ([h.body for h in node.handlers] if isinstance(node, ast.Try) else [])
            for block in blocks:
                found = _defines(block, name)
                if found is not None:
                    return found
    return None


def find(dotted: str) -> str | None:
    """None when ``dotted`` (``pkg.module.Name[.attr]`` or ``pkg.module:Name``) is defined in
    the source; else what is missing, e.g. ``"no 'Scheduler' in .../scheduler.py"``."""
    parts = dotted.replace(":", ".").split(".")
    located = module_file(parts)
    if located is None:
        return f"package {parts[0]!r} is not installed"
    path, used = located
    rest = parts[used:]
    if not rest:
        return None
    if path is None:
        return f"no module {'.'.join(parts[: used + 1])!r} (nor a name in the namespace package {'.'.join(parts[:used])})"
    try:
        body = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        return f"{path} cannot be read: {type(e).__name__}: {e}"
    for depth, name in enumerate(rest):
        node = _defines(body, name)
        if node is None:
            where = ".".join(parts[: used + depth])
            return f"no {name!r} in {where} ({path})"
        if depth + 1 < len(rest):
            if not isinstance(node, ast.ClassDef):
                return f"{'.'.join(parts[: used + depth + 1])} is not a class defined in {path}; cannot look inside"
            body = node.body
    return None

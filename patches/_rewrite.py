"""Audited source rewrites of megatron-core functions.

A patch names a function and the exact snippets it replaces. The function's
source is read, every snippet is substituted, and the result is compiled in the
function's own module namespace. If a snippet is not found the patch raises
:class:`PatchError` instead of silently doing nothing, so an upstream change is
noticed at start-up rather than as a wrong result mid-training.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import textwrap
from collections.abc import Callable, Iterable, Sequence

from trainmover_ext.errors import PatchError

Replacement = tuple[str, str]


def _compile_function(module, cls, name: str, source: str, filename: str) -> Callable:
    """Compile ``source`` (one def, possibly decorated) inside ``module``'s globals."""
    source = textwrap.dedent(source)
    if cls is None:
        namespace: dict = {}
        exec(compile(_remember(source, filename), filename, "exec"), module.__dict__, namespace)
        return namespace[name]
    # Methods may use zero-argument super(), which needs a __class__ cell: build
    # the function inside a factory whose argument is that cell.
    body = textwrap.indent(source, "    ")
    factory_src = f"def __tm_factory(__class__):\n{body}\n    return {name}\n"
    namespace = {}
    exec(compile(_remember(factory_src, filename), filename, "exec"), module.__dict__, namespace)
    return namespace["__tm_factory"](cls)


def _remember(source: str, filename: str) -> str:
    """Keep ``source`` in linecache under ``filename``: tracebacks show the patched lines, and a
    second patch of the same function (a CPU patch and a migration patch) can read its source."""
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare with)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return source


def rewrite(module_name: str, qualname: str, replacements: Sequence[Replacement], require_each: bool = True) -> None:
    """Replace snippets in ``module_name.qualname`` and install the new function.

    ``qualname`` is ``func`` or ``Class.method``. With ``require_each`` every
    ``(old, new)`` pair must occur in the source; otherwise at least one must.
    A miss raises :class:`PatchError`. Static and class methods keep their
    descriptor type.
    """
    module = importlib.import_module(module_name)
    parts = qualname.split(".")
    cls = getattr(module, parts[0]) if len(parts) == 2 else None
    name = parts[-1]
    owner = cls if cls is not None else module
    raw = owner.__dict__[name] if cls is not None else getattr(module, name)
    descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if descriptor else raw
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError) as exc:
        raise PatchError(f"cannot read the source of {module_name}.{qualname}: {exc}") from exc
    hits = 0
    for old, new in replacements:
        if old in source:
            hits += 1
            source = source.replace(old, new)
        elif require_each:
            raise PatchError(
                f"{module_name}.{qualname} no longer contains {old!r}; this megatron-core is not "
                "the version the patches were written for. Install megatron-core==0.16.1 (0.19.2 on "
                "Python 3.12) or update patches/."
            )
    if hits == 0:
        raise PatchError(
            f"{module_name}.{qualname} contains none of the snippets the patch expects; install "
            "megatron-core==0.16.1 (0.19.2 on Python 3.12) or update patches/."
        )
    if descriptor is not None:
        # Drop the @staticmethod/@classmethod line: we re-wrap below.
        lines = [ln for ln in source.splitlines() if ln.strip() not in ("@staticmethod", "@classmethod")]
        source = "\n".join(lines) + "\n"
    filename = f"<trainmover patch of {module_name}.{qualname}>"
    new_func = _compile_function(module, cls, name, source, filename)
    if descriptor is not None:
        new_func = descriptor(new_func)
    setattr(owner, name, new_func)
    if cls is None:
        _rebind_imported_names(raw, new_func)


def _rebind_imported_names(old, new) -> None:
    """Point ``from module import name`` copies in other megatron modules at ``new``."""
    import sys

    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron."):
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, attr, new)


def rewrite_all(targets: dict[str, Iterable[str]], replacements: Sequence[Replacement]) -> list[str]:
    """Apply, in order, every replacement that occurs in each target.

    Each target must contain at least one of the snippets. Returns the list of
    patched qualified names.
    """
    patched = []
    for module_name, qualnames in targets.items():
        for qualname in qualnames:
            rewrite(module_name, qualname, replacements, require_each=False)
            patched.append(f"{module_name}.{qualname}")
    return patched

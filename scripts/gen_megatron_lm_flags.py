"""Generate ``trainmover_training/data/megatron_lm_flags.json``: every flag of Megatron-LM's
``megatron/training/arguments.py`` at a pinned commit, with its arity and argument group.

Megatron-LM builds part of its parser from megatron-core's config dataclasses, so the list is read
from the parser itself, not from the file's text: the tree at the pinned ref is extracted to a temporary
folder and its ``add_megatron_arguments`` is run. Third-party modules the import chain reaches but
this environment lacks (six, triton) are replaced by inert stand-ins; no Megatron-LM code runs
beyond building the parser.

Usage (a Megatron-LM clone; no network is needed)::

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python scripts/gen_megatron_lm_flags.py --megatron-lm /tmp/Megatron-LM            # rewrite
    python scripts/gen_megatron_lm_flags.py --megatron-lm /tmp/Megatron-LM --check    # exit 1 if stale

The ref is ``core_v0.16.1``, the Megatron-LM release of the pinned megatron-core; change it with ``--ref``
when the pin moves.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "trainmover_training", "data", "megatron_lm_flags.json")
DEFAULT_REF = "core_v0.16.1"


class _Inert:
    """Stands in for anything of a missing third-party module: callable (a decorator returns what it
    decorates), indexable, falsy."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Inert()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __getitem__(self, key):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)


class _InertModule(types.ModuleType):
    __path__: list[str] = []
    __version__ = "0.0.0"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


def _import_arguments(tree: str, attempts: int = 40) -> tuple[types.ModuleType, list[str]]:
    """``megatron.training.arguments`` from ``tree``, with missing third-party modules stood in for."""
    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    stood_in: list[str] = []
    for _ in range(attempts):
        try:
            return importlib.import_module("megatron.training.arguments"), stood_in
        except ModuleNotFoundError as e:
            if e.name is None or e.name.startswith("megatron"):
                raise
            stood_in.append(e.name)
            parts = e.name.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), _InertModule(".".join(parts[:i])))
            for name in [m for m in sys.modules if m.startswith("megatron")]:
                del sys.modules[name]
    raise RuntimeError(f"megatron.training.arguments still fails to import after standing in for {stood_in}")


def _arity(action: argparse.Action) -> int | str:
    """0 for a flag without a value, else argparse's nargs (1 for a single value)."""
    if action.nargs is None:
        return 1
    return action.nargs


def flag_records(parser: argparse.ArgumentParser) -> list[dict]:
    """One record per option of ``parser`` (help left out): its option strings, arity and group."""
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}  # no public accessor
    records = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        records.append(
            {
                "flags": sorted(action.option_strings),
                "nargs": _arity(action),
                "group": group_of.get(id(action)) or "",
            }
        )
    return sorted(records, key=lambda r: r["flags"][0])


def generate(megatron_lm: str, ref: str) -> dict:
    commit = subprocess.run(
        ["git", "-C", megatron_lm, "rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="megatron-lm-") as tree:
        archive = subprocess.run(
            ["git", "-C", megatron_lm, "archive", commit, "megatron"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        module, stood_in = _import_arguments(tree)
        parser = argparse.ArgumentParser(allow_abbrev=False)
        module.add_megatron_arguments(parser)
        records = flag_records(parser)
    return {
        "source": "https://github.com/NVIDIA/Megatron-LM",
        "file": "megatron/training/arguments.py (add_megatron_arguments)",
        "ref": ref,
        "commit": commit,
        "generator": "scripts/gen_megatron_lm_flags.py",
        "stood_in": sorted(set(stood_in)),
        "flags": records,
    }


def render(listing: dict) -> str:
    """The list as JSON, one option a line (diffs stay readable when the pin moves)."""
    head = {k: v for k, v in listing.items() if k != "flags"}
    lines = [json.dumps(head, indent=1)[:-2] + ',\n "flags": [']
    lines += [" " + json.dumps(r) + "," for r in listing["flags"]]
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join(lines) + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--megatron-lm", required=True, help="A git clone of Megatron-LM holding --ref.")
    p.add_argument("--ref", default=DEFAULT_REF, help=f"Tag or commit to read (default {DEFAULT_REF}).")
    p.add_argument("--out", default=OUT, help="Where to write the list (default: the packaged one).")
    p.add_argument("--check", action="store_true", help="Exit 1 if --out differs from what would be written.")
    args = p.parse_args(argv)
    text = render(generate(args.megatron_lm, args.ref))
    if args.check:
        with open(args.out) as f:
            if f.read() != text:
                print(f"{args.out} is stale: rerun without --check and commit it", file=sys.stderr)
                return 1
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(json.loads(text)['flags'])} options of Megatron-LM {args.ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

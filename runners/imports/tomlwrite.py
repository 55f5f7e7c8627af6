"""The hosts file written from an Imported: the unmapped keys as comments at the top,
then one `[hosts.NAME]` table a program, keys in the order the translator gave them."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from runners.imports.programs import Imported

BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if BARE.fullmatch(k) else json.dumps(k)


def value(v: Any) -> str:
    """A TOML value: JSON's strings and numbers are TOML's (its escapes are a subset)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float | str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def render(imp: Imported, out_dir: str | None = None) -> str:
    """The file's text; `build` and `cwd` relative to `out_dir` when under it."""
    lines = [f"# Imported by `vigil import` from {imp.source} ({imp.fmt}).",
             "# vigil apply --dry-run THIS_FILE shows what applying it does."]
    if imp.unmapped:
        lines.append(f"# Not imported ({len(imp.unmapped)}), each with why:")
        lines += [f"#   {line}" for line in imp.unmapped]
    for p in imp.programs:
        lines += ["", f"[hosts.{p.name}]"]
        for k, v in p.keys.items():
            if k in ("build", "cwd") and out_dir is not None:
                v = _relative(v, out_dir)
            lines.append(f"{_key(k)} = {value(v)}")
    return "\n".join(lines) + "\n"


def _relative(path: str, out_dir: str) -> str:
    """Relative when inside out_dir (the file moves with the app), else absolute."""
    rel = os.path.relpath(path, out_dir)
    return path if rel.startswith("..") else rel

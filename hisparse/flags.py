"""Command-line flags made from the config dataclasses: each flag's default and description are its field's.

A config field is written once — its default and its docstring in `core.configs` — and the command line reads
both from there, so a default cannot drift between the dataclass, the parser and its help text. A `Flag` names
the config class and field it sets; its value lands in `args` under `Class.field`, and `config(cls, args)`
builds the config back from those values (what the flags do not set keeps the dataclass default).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from core.configs import format_bytes


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (and of its bases), by field name."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                out[node.target.id] = " ".join(after.value.value.split())
    return out


def default_of(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default")


def _first_sentence(text: str) -> str:
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _shown(value: Any, is_bytes: bool) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if is_bytes and isinstance(value, int):
        return format_bytes(value)
    return str(value)


def dest(cls: type, name: str) -> str:
    return f"{cls.__name__}.{name}"


@dataclass(frozen=True)
class Flag:
    """One command-line flag that sets `cls.name`."""

    flag: str
    cls: type
    name: str
    kw: dict = field(default_factory=dict)
    """What else argparse needs: type, choices, metavar, action."""
    help: str | None = None
    """A description of its own; default: the first sentence of the field's docstring."""
    bytes: bool = False
    """The value is a byte size (shown with its unit)."""

    def add(self, group, default: Any = dataclasses.MISSING) -> None:
        value = default_of(self.cls, self.name) if default is dataclasses.MISSING else default
        text = self.help or _first_sentence(field_docs(self.cls).get(self.name, ""))
        if value is not None and self.kw.get("action") not in ("store_true", "store_false"):
            text = f"{text} (default {_shown(value, self.bytes)})"
        kw = dict(self.kw)
        if kw.get("action") == "store_false":
            value = True
        if "action" not in kw and "choices" not in kw:
            kw.setdefault("metavar", self.name.upper())
        group.add_argument(self.flag, dest=dest(self.cls, self.name), default=value, help=text, **kw)


def add_flags(group, flags: list[Flag], defaults: dict[str, Any] | None = None) -> None:
    """Add every flag to `group`; `defaults` (flag -> value) overrides a field default for this command only."""
    for f in flags:
        f.add(group, (defaults or {}).get(f.flag, dataclasses.MISSING))


def config(cls: type, args: argparse.Namespace, **extra: Any):
    """`cls` built from the flags that set its fields (the others keep their defaults), plus `extra`."""
    prefix = cls.__name__ + "."
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return cls(**{**values, **extra})

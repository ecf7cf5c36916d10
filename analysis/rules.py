"""Thresholds: `analysis/rules.toml` holds the documented defaults, a user file overrides them.

    rules = load_rules()                    # the defaults
    rules = load_rules("my-rules.toml")     # `--rules FILE`: any subset of the keys
    rules.straggler.min_ratio               # 1.1

The override may name only sections and keys the defaults have, with a value
of the same type (an int where a float is expected is fine): a typo is an error
that names it, not a threshold silently left at its default. Loading reads a
file; it is the one function of `analysis` that does, and the collector calls
it once at start, never per pass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the file and the key."""


class Section:
    """One section's keys, read-only, as attributes."""

    __slots__ = ("name", "_values")

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        self.name = name
        self._values = MappingProxyType(dict(values))

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"rules [{self.name}] has no key {key!r}") from None

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"Section({self.name!r}, {dict(self._values)!r})"


class Rules:
    """Every section of the rules."""

    __slots__ = ("_sections", "source")

    def __init__(self, sections: Mapping[str, Mapping[str, Any]], source: str = "defaults") -> None:
        self._sections = {name: Section(name, values) for name, values in sections.items()}
        self.source = source

    def __getattr__(self, name: str) -> Section:
        try:
            return self._sections[name]
        except KeyError:
            raise AttributeError(f"rules have no section [{name}]") from None

    def __getitem__(self, name: str) -> Section:
        return self._sections[name]

    def __contains__(self, name: str) -> bool:
        return name in self._sections

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: s.as_dict() for name, s in self._sections.items()}


def default_rules_text() -> str:
    return resources.files("analysis").joinpath("rules.toml").read_text(encoding="utf-8")


def _same_type(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, list):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, type(default))


def merge_rules(defaults: Mapping[str, Mapping[str, Any]], override: Mapping[str, Any], *,
                source: str = "override") -> dict[str, dict[str, Any]]:
    """`defaults` with `override`'s keys replaced; unknown sections, keys and types refused."""
    merged = {name: dict(values) for name, values in defaults.items()}
    for name, values in override.items():
        if name not in merged:
            raise RulesError(f"{source}: unknown section [{name}] (known: {', '.join(merged)})")
        if not isinstance(values, Mapping):
            raise RulesError(f"{source}: [{name}] must be a table of keys")
        for key, value in values.items():
            if key not in merged[name]:
                raise RulesError(f"{source}: [{name}] has no key {key!r} (known: {', '.join(merged[name])})")
            default = merged[name][key]
            if not _same_type(default, value):
                raise RulesError(f"{source}: [{name}] {key} = {value!r} must be a {type(default).__name__}")
            merged[name][key] = float(value) if isinstance(default, float) else value
    return merged


def load_rules(path: str | os.PathLike | None = None) -> Rules:
    """The defaults, overridden by the TOML file at `path` when given."""
    defaults = tomllib.loads(default_rules_text())
    if path is None:
        return Rules(defaults)
    try:
        with open(path, "rb") as f:
            override = tomllib.load(f)
    except OSError as e:
        raise RulesError(f"{path}: cannot read the rules file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise RulesError(f"{path}: not valid TOML ({e})") from None
    return Rules(merge_rules(defaults, override, source=str(path)), source=str(path))


def rules_from_dict(override: Mapping[str, Any] | None = None) -> Rules:
    """The defaults with `override` applied (tests, replay sweeps over thresholds)."""
    defaults = tomllib.loads(default_rules_text())
    return Rules(merge_rules(defaults, override or {}), source="dict")

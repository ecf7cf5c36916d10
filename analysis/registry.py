"""Detectors register here by name; the engine runs them in registration order.

A detector is a class with

    name: str                               # also its section in the rules
    kinds: tuple[str, ...]                  # the incident kinds it emits
    def __init__(self, rules: Rules)        # reads its section (and others it needs)
    def new_state(self) -> object           # its bounded per-run state
    def run(self, p: Pass, state) -> None   # one pass: reads p, reports to p.book

`run` reads the pass (`analysis.state.Pass`: the run's new rows, the steps that
became complete, the shared per-run state, `now`) and reports findings through
`p.report(...)` / `p.resolve(...)`. It must not read a clock or do I/O, and it
must not reread history: what it needs of the past lives in its state.

Order matters where one detector defers to another (crash before hang: a hang
whose culprit crashed is the crash; nan before the spikes; loss before grad
spikes); `analysis/detectors/__init__.py` imports them in that order.
"""

from __future__ import annotations

from typing import Protocol

from analysis.rules import Rules


class Detector(Protocol):
    name: str
    kinds: tuple[str, ...]

    def __init__(self, rules: Rules) -> None: ...

    def new_state(self) -> object: ...

    def run(self, p, state) -> None: ...


_DETECTORS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: add a detector under `cls.name` (a name registered twice is an error)."""
    name = getattr(cls, "name", None)
    if not name or not isinstance(name, str):
        raise TypeError(f"{cls.__name__} needs a `name`")
    if name in _DETECTORS and _DETECTORS[name] is not cls:
        raise ValueError(f"detector {name!r} is already registered ({_DETECTORS[name].__name__})")
    _DETECTORS[name] = cls
    return cls


def detector_names() -> list[str]:
    _load_builtin()
    return list(_DETECTORS)


def detector_class(name: str) -> type:
    _load_builtin()
    try:
        return _DETECTORS[name]
    except KeyError:
        raise KeyError(f"no detector {name!r} (registered: {', '.join(_DETECTORS)})") from None


def build_detectors(rules: Rules, names: list[str] | None = None) -> list:
    """Instances of the named detectors (default: all, in order) whose rules section
    does not say `enabled = false`."""
    _load_builtin()
    chosen = list(_DETECTORS) if names is None else [detector_class(n).name for n in names]
    out = []
    for name in chosen:
        section = rules[name] if name in rules else None
        if section is not None and not section.as_dict().get("enabled", True):
            continue
        out.append(_DETECTORS[name](rules))
    return out


def _load_builtin() -> None:
    import analysis.detectors  # noqa: F401  (registers the built-in detectors on import)

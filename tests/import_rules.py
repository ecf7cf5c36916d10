"""DESIGN.md's import direction, checked on the source (ast, nothing imported):

- `agent` imports nothing of ours, and at module level only the standard library
  and itself: torch, numpy and the frameworks' bridges only inside functions (a rank
  that never calls them never pays for them), and never duckdb, polars, pyarrow,
  dash or plotly (a training rank stays light). A framework's callback module
  (agent/integrations/hf.py, lightning.py) subclasses that framework's base class, so
  it imports that framework at module level; only a job of that framework imports it;
- `analysis` is pure: nothing of `collector`, `trainer`, `dashboard` or `agent`, no
  duckdb, no HTTP, no thread, no clock read;
- `trainer` imports nothing of `collector`, `analysis` or `dashboard`;
- `collector` never imports `dashboard`.

    python -m tests.import_rules          # prints each violation, exits 1 if any

`violations(root)` is what tests/unit/test_gates.py asserts empty, and shows failing on
planted violations.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("agent", "analysis", "collector", "dashboard", "trainer")
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
NEVER_IN_AGENT = ("duckdb", "polars", "pyarrow", "dash", "plotly")
HTTP = ("httpx", "requests", "urllib.request", "http.client", "urllib3", "aiohttp")
CLOCKS = {("time", "time"), ("time", "time_ns"), ("time", "monotonic"), ("time", "monotonic_ns"),
          ("time", "perf_counter"), ("time", "perf_counter_ns"), ("datetime", "now"), ("datetime", "utcnow"),
          ("date", "today")}
BRIDGES = {"agent/integrations/hf.py": ("transformers",),
           "agent/integrations/lightning.py": ("lightning", "pytorch_lightning")}
FORBIDDEN = {  # package -> packages (or modules) it must not import, anywhere in it
    "agent": tuple(p for p in OURS if p != "agent") + NEVER_IN_AGENT,
    "analysis": ("collector", "trainer", "dashboard", "agent", "duckdb", "threading", "_thread") + HTTP,
    "trainer": ("collector", "analysis", "dashboard"),
    "collector": ("dashboard",),
}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}"


def _under(name: str, prefixes: tuple[str, ...]) -> str | None:
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return p
    return None


def _imports(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import, relative ones skipped (they stay inside
    their package); `from a import b` yields `a` and `a.b` (b may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            for a in node.names:
                yield f"{node.module}.{a.name}", node.lineno


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the imports that run when the module is imported: those in its body,
    including under `if`/`try` at the top (not inside a def or class body's methods)."""
    out: set[int] = set()

    def visit(stmts):
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                out.add(id(s))
            elif isinstance(s, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(s, field, []) or [])
                for h in getattr(s, "handlers", []) or []:
                    visit(h.body)
    visit(tree.body)
    return out


def _clock_reads(tree: ast.Module) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in CLOCKS:
                yield f"{node.value.id}.{node.attr}", node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            for a in node.names:
                if (node.module, a.name) in CLOCKS:
                    yield f"from {node.module} import {a.name}", node.lineno


def check_file(path: Path, package: str, rel: str) -> list[Violation]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = rel.replace("\\", "/")
    eager = _module_level(tree)
    eager_lines = {n.lineno for n in ast.walk(tree) if id(n) in eager}
    out, seen = [], set()
    for name, line in _imports(tree):
        if line in seen:
            continue
        bad = _under(name, FORBIDDEN.get(package, ()))
        if bad:
            seen.add(line)
            out.append(Violation(rel, line, f"{package} imports {name} (DESIGN.md: {package} never imports {bad})"))
        elif package == "agent" and line in eager_lines:
            root = name.split(".")[0]
            if root not in STDLIB and root != "agent" and root not in BRIDGES.get(rel, ()):
                seen.add(line)
                out.append(Violation(rel, line, f"agent imports {name} at module level (only the standard "
                                                "library there; torch and the bridges inside functions)"))
    if package == "analysis":
        for what, line in _clock_reads(tree):
            out.append(Violation(rel, line, f"analysis reads a clock ({what}): it is handed `now`"))
    return out


def violations(root: Path = ROOT) -> list[Violation]:
    out = []
    for package in FORBIDDEN:
        for path in sorted((root / package).rglob("*.py")):
            out += check_file(path, package, str(path.relative_to(root)))
    return out


def main() -> int:
    found = violations()
    for v in found:
        print(v)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

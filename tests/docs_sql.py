"""The named SQL blocks of a docs page: a `### name` heading, then one ```sql block."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
COOKBOOK = DOCS / "postmortem.md"


def sql_blocks(path: Path = COOKBOOK) -> dict[str, str]:
    """name -> SQL text for every ```sql block, named by the nearest `### ` heading
    above it. A heading with two blocks, or a block without a heading, is an error:
    each query must be addressable by its name."""
    out: dict[str, str] = {}
    name, block = None, None
    for line in path.read_text().splitlines():
        if block is not None:
            if line.strip() == "```":
                if name is None or name in out:
                    raise ValueError(f"{path.name}: SQL block without a heading of its own (after {name!r})")
                out[name] = "\n".join(block)
                block = None
            else:
                block.append(line)
        elif line.startswith("### "):
            name = line[4:].strip()
        elif line.strip() == "```sql":
            block = []
    return out

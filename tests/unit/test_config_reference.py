"""docs/configuration.md (and the schema version in docs/operations.md) match the code."""

from __future__ import annotations

import argparse
import re

import pytest

from tests import config_reference as ref

FIX = "run `python -m tests.config_reference --write` and commit the result"


def _sections(text: str, level: str = "### ") -> dict[str, str]:
    """heading text -> the text up to the next heading of that level."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith(level):
            if name is not None:
                out[name] = "\n".join(lines)
            name, lines = line[len(level):].strip().strip("`"), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines)
    return out


@pytest.fixture(scope="module")
def page() -> str:
    return ref.CONFIGURATION.read_text()


def test_the_pages_match_the_code() -> None:
    diffs = ref.drift()
    assert not diffs, f"generated docs drifted from the code; {FIX}:\n" + "\n".join(diffs.values())


def test_every_flag_of_every_command_is_in_its_section(page: str) -> None:
    sections = _sections(page)
    flags = ref.all_flags()
    commands = {f.command for f in flags}
    assert {"trainer", "collector serve", "collector sql", "collector replay", "collector postmortem",
            "dashboard"} <= commands
    missing = [f"{f.command} {f.names[0]}" for f in flags
               if f"| `{f.names[0]}" not in sections.get(f.command, "")]
    assert not missing, f"flags missing from docs/configuration.md ({FIX}): {missing}"
    assert len(flags) > 100  # every CLI was walked, subcommands and argument groups included


def test_every_subcommand_has_a_section(page: str) -> None:
    import collector.cli

    sub = next(a for a in collector.cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    sections = _sections(page)
    assert [name for name in sub.choices if f"collector {name}" not in sections] == []


def test_every_rules_key_is_in_its_section_with_its_default_and_a_meaning(page: str) -> None:
    sections = _sections(page)
    keys = ref.rules_keys()
    assert {"steps", "nan", "straggler", "hang", "crash", "policy"} <= set(keys)
    for section, values in keys.items():
        body = sections.get(f"[{section}]")
        assert body is not None, f"no section [{section}] ({FIX})"
        for key, default in values.items():
            row = re.search(rf"^\| `{key}` \| `([^`]*)` \| [^|]+ \| (.+) \|$", body, re.M)
            assert row, f"[{section}] {key} missing ({FIX})"
            assert row.group(1) == ref._toml_value(default)
            assert row.group(2).strip(), f"[{section}] {key} has no meaning: comment it in rules.toml or docs/rules.md"


def test_rules_defaults_are_the_loaded_ones() -> None:
    from analysis.rules import load_rules

    rules = load_rules()
    assert ref.rules_keys()["straggler"]["min_ratio"] == rules.straggler.min_ratio == 1.1
    assert ref.rules_keys()["hang"]["long_phases"] == list(rules.hang.long_phases)


def test_every_environment_variable_the_code_names_is_described(page: str) -> None:
    found = ref.env_uses()
    assert {"LLMWATCH_TOKEN", "LLMWATCH_INGEST_TOKEN", "LLMWATCH_WEBHOOK_SECRET", "RANK"} <= set(found)
    undescribed = sorted(set(found) - set(ref.ENV_VARS))
    assert not undescribed, f"describe these in tests/config_reference.py ENV_VARS: {undescribed}"
    stale = sorted(set(ref.ENV_VARS) - set(found))
    assert not stale, f"ENV_VARS describes names no code uses any more: {stale}"
    env = _sections(page, "## ")["Environment variables"]
    assert [n for n in found if f"| `{n}` |" not in env] == []


def test_env_scan_sees_reads_keywords_and_fstrings(tmp_path) -> None:
    pkg = tmp_path / "agent"
    pkg.mkdir()
    for other in ref.PACKAGES[1:]:
        (tmp_path / other).mkdir()
    (pkg / "m.py").write_text(
        "import os\n"
        "a = os.environ.get('OMP_NUM_THREADS')\n"
        "b = os.environ['RANK']\n"
        "c = dict(os.environ, LLMWATCH_NODE='n')\n"
        "d = {r: f'LLMWATCH_{r}_TOKEN' for r in ('READ',)}\n"
        "e = 'LLMWATCH_PROGRESS'\n"
        "f = 'not an env name'\n")
    found = ref.env_uses(tmp_path)
    assert set(found) >= {"OMP_NUM_THREADS", "RANK", "LLMWATCH_NODE", "LLMWATCH_PROGRESS",
                          "LLMWATCH_READ_TOKEN", "LLMWATCH_INGEST_TOKEN", "LLMWATCH_CONTROL_TOKEN"}
    assert found["RANK"] == {"agent/m.py"}
    assert "not an env name" not in found


def _toy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("run", help="run it")
    s.add_argument("--db", required=True, help="a | pipe and a <tag>")
    s.add_argument("--size", type=int, default=2 << 20, help="bytes (default %(default)s)")
    g = s.add_argument_group("extras", "more knobs")
    g.add_argument("--mode", choices=("a", "b"), default="a")
    g.add_argument("--hook", action="append", default=[], metavar="URL")
    x = s.add_mutually_exclusive_group()
    x.add_argument("--fast", action="store_true")
    x.add_argument("--slow", action="store_true")
    q = sub.add_parser("ask", help="ask it")
    q.add_argument("question")
    return p


def test_walk_visits_subcommands_and_groups() -> None:
    walked = {cmd: (p, h) for cmd, p, h in ref.walk(_toy_parser(), "toy")}
    assert list(walked) == ["toy", "toy run", "toy ask"]
    assert walked["toy run"][1] == "run it"
    flags = {f.names[0]: f for f in ref.flags_of(walked["toy run"][0], "toy run")}
    assert flags["--db"].default == "**required**" and flags["--db"].group == "arguments"
    assert flags["--size"].default == "`2097152` (2 MiB)" and flags["--size"].help == "bytes (default 2097152)"
    assert flags["--mode"].group == "extras" and flags["--mode"].choices == ("a", "b")
    assert flags["--hook"].repeatable and flags["--hook"].default == "`[]`"
    (ask,) = ref.flags_of(walked["toy ask"][0], "toy ask")
    assert ask.names == ("QUESTION",) and ask.default == "**required**"
    assert ref._exclusive_notes(walked["toy run"][0]) == ["At most one of `--fast`, `--slow`."]


def test_a_table_cell_escapes_pipes_and_tags_but_not_inside_code() -> None:
    (row,) = ref._table(["a", "b"], [["x | y <z>", "`a|b <c>`"]])[2:]
    assert row == "| x \\| y &lt;z> | `a\\|b <c>` |"


def test_render_rewrites_only_between_markers() -> None:
    text = ("intro\n<!-- BEGIN GENERATED: x -->\nold\n<!-- END GENERATED: x -->\n"
            "hand-written prose\n")
    out = ref.render(text, {"x": lambda: ["new", "lines"]})
    assert out == ("intro\n<!-- BEGIN GENERATED: x -->\nnew\nlines\n<!-- END GENERATED: x -->\n"
                   "hand-written prose\n")
    assert ref.render(out, {"x": lambda: ["new", "lines"]}) == out
    with pytest.raises(ValueError, match="exactly one"):
        ref.render("no markers here", {"x": lambda: []})
    with pytest.raises(ValueError, match="unknown"):
        ref.render(text + "<!-- BEGIN GENERATED: y -->\n<!-- END GENERATED: y -->\n", {"x": lambda: []})

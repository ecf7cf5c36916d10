"""The generated parts of docs/configuration.md (and the schema version in docs/operations.md).

    python -m tests.config_reference --write    rewrite the generated blocks in place
    python -m tests.config_reference --check    exit 1 with a diff when a page drifted

Each generated block sits between `<!-- BEGIN GENERATED: name -->` and
`<!-- END GENERATED: name -->`; only what is between them is rewritten, so the prose
around them is hand-written and survives. The sources:

- the flags: each CLI's `build_parser()`, walked through its subcommands and argument
  groups (the default as argparse has it; for `trainer`, whose flags default to
  "not given", the `JobConfig` value the flag overrides);
- the rules keys: `analysis/rules.toml` as `analysis.rules` loads it, each key's
  meaning from its comment there, else from its row in docs/rules.md;
- the environment variables: every `LLMWATCH_*` / `TORCHELASTIC_*` name and every
  name read through `environ` in agent/, collector/, trainer/, dashboard/, analysis/,
  described by `ENV_VARS` below (a name found in the code without a description is
  an error: tests/unit/test_config_reference.py says which).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
OPERATIONS = ROOT / "docs" / "operations.md"
RULES_DOC = ROOT / "docs" / "rules.md"
RULES_TOML = ROOT / "analysis" / "rules.toml"
PACKAGES = ("agent", "collector", "trainer", "dashboard", "analysis")

# (the command as typed, the module whose build_parser() defines it)
CLIS = (("trainer", "trainer.cli"), ("collector", "collector.cli"), ("dashboard", "dashboard.cli"),
        ("python -m agent.replay", "agent.replay"), ("llmwatch-instrument", "agent.instrument"))

_BEGIN = "<!-- BEGIN GENERATED: {} -->"
_END = "<!-- END GENERATED: {} -->"
_MiB = 1 << 20
_UNTITLED = ("positional arguments", "options", "optional arguments")

# --- environment variables ------------------------------------------------------------
# name -> (who sets it, what it means). "you" = an operator may set it; "launcher" =
# internal, set by `trainer` for its ranks (do not set it yourself); "torchrun" = set by
# torchrun / the elastic agent; "trainer" = set for a hook the trainer runs.
ENV_VARS: dict[str, tuple[str, str]] = {
    "LLMWATCH_TOKEN": ("you", "A bearer token with every role. `collector serve` accepts it (beside the role "
                       "tokens); `trainer --telemetry --collector URL`, `collector sql --url`, `dashboard "
                       "--collector` and `python -m agent.replay` send it when no `--token-file` is given; "
                       "`collector relay` takes it as the ingest token it checks and sends upstream."),
    "LLMWATCH_INGEST_TOKEN": ("you", "`collector serve`: a token with the ingest role (the ranks' agents)."),
    "LLMWATCH_READ_TOKEN": ("you", "`collector serve`: a token with the read role (dashboard, SQL, `/metrics`)."),
    "LLMWATCH_CONTROL_TOKEN": ("you", "`collector serve`: a token with the control role (commands; it may "
                               "read too)."),
    "LLMWATCH_WEBHOOK_SECRET": ("you", "The webhooks' HMAC key, when no `--webhook-secret-file` is given "
                                "(`collector serve`, `trainer` for its embedded collector)."),
    "LLMWATCH_HW_ID": ("you", "This rank's hardware id, for a host whose GPU NVML cannot name (a CPU host, a "
                              "test): the agent sends it with every batch (`ranks.hw_id`), and a node's history "
                              "across runs follows it (docs/rules.md `[node_history]`). Default: the GPU's NVML "
                              "UUID, else none."),
    "LLMWATCH_NODE_NAME": ("you", "Under `torchrun`: this node's name, set per elastic agent (one agent per "
                           "node); the ranks publish it so every rank knows the node map."),
    "LLMWATCH_NODE_INDEX": ("you", "Under `torchrun`: this node's index in the job's first layout, set per "
                            "agent; with `LOCAL_RANK` it gives the hardware rank an `--inject` names."),
    "LLMWATCH_EMBEDDED": ("launcher", "`1` in ranks the embedded launcher started (it prints the run's "
                          "notes once for all ranks; `llmwatch-instrument` leaves such a rank alone)."),
    "LLMWATCH_PROGRESS": ("launcher", "`1`: rank 0 prints per-step progress (set from `--no-progress`)."),
    "LLMWATCH_HW_RANK": ("launcher", "The rank's slot in the first layout (what `--inject rank=R` means) "
                         "after an elastic restart renumbered the ranks."),
    "LLMWATCH_ORIG_WORLD": ("launcher", "The world size of the first layout (injections are validated "
                            "against it)."),
    "LLMWATCH_NODE_NAMES": ("launcher", "Comma-separated names of the nodes of the current layout (the "
                            "surviving nodes keep their names after an isolation)."),
    "LLMWATCH_SPARE_NODES": ("launcher", "Comma-separated names of the standby nodes (`--spare-nodes`; under "
                             "`torchrun` you set it on every agent to the standby agents' node names): rank 0 "
                             "reports those that hold no ranks and were not isolated, and the collector lists "
                             "them as `spare` nodes."),
    "LLMWATCH_ATTEMPT_FLOOR": ("launcher", "The lowest training attempt a restarted job may use (attempts "
                               "never go back after a restart)."),
    "LLMWATCH_RESTART_ROUND": ("launcher", "How many times the embedded supervisor restarted the job."),
    "LLMWATCH_LIFELINE_FD": ("launcher", "The read end of the launcher's lifeline pipe: a rank exits when "
                             "the launcher is gone."),
    "LLMWATCH_ZYGOTE": ("you", "The embedded launcher forks its ranks from a zygote that imported torch once "
                        "(trainer/zygote.py): unset, with a CPU build of torch; `1` with a GPU build too; `0` "
                        "never (every rank a process that imports torch itself)."),
    "LLMWATCH_SIDECAR_NICE": ("you", "`trainer --telemetry`: how much lower than the ranks the embedded collector "
                                     "and dashboard run (0 to 19; 0, the ranks' priority, when unset). 10 made "
                                     "telemetry on/off 1.005 against 0.945 in steady state on 2 CPU-bound cores, "
                                     "but detection then trails such ranks by more steps."),
    "LLMWATCH_COLLECTIVES": ("you", "Every agent (our trainer's, `watch()`, the integrations): `ops` ships a row "
                                    "per communication op; `summary` one row per (step, op, axis, group, peer) "
                                    "instead, with op rows for every 100th step and while an incident asks "
                                    "(agent/summary.py); `auto` (the default) summarizes in a job of 256 ranks "
                                    "or more."),
    "LLMWATCH_FLUSH_S": ("you", "An agent made without a flush period (`watch()`, `llmwatch-instrument`, the "
                                "`agent.integrations` callbacks): how often it ships a batch, in seconds "
                                "(default 1). With `LLMWATCH_HEARTBEAT_S` for jobs too large to post every "
                                "second (docs/scale.md)."),
    "LLMWATCH_HEARTBEAT_S": ("you", "The same agents' heartbeat period in seconds (default 1): each heartbeat "
                                    "ships a batch and says its interval, and the collector reads a rank as "
                                    "silent after 3 of them at least (`[crash] silence_beats`)."),
    "CUDA_VISIBLE_DEVICES": ("you", "The agent's device-health sampler maps `LOCAL_RANK` through it to the GPU "
                                    "NVML reads (an index or a UUID entry)."),
    "LLMWATCH_URL": ("you", "`agent.watch.watch()`, `llmwatch-instrument` and the `agent.integrations` "
                            "callbacks: the collector's URL (when none is passed; behind a node's relay, the "
                            "relay's); `collector relay`: its upstream when `--upstream` is not given."),
    "LLMWATCH_TOKEN_FILE": ("you", "`watch()`, `llmwatch-instrument` and the `agent.integrations` callbacks: a "
                                   "file holding the ingest token (when no token is passed and `LLMWATCH_TOKEN` "
                                   "is unset); `collector relay` too, when no `--token-file` is given."),
    "LLMWATCH_RUN_ID": ("trainer", "Set for the `--on-isolate` command: the run. `watch()`, "
                                   "`llmwatch-instrument` and the `agent.integrations` callbacks read it as the "
                                   "run id when none is passed."),
    "LLMWATCH_INSTRUMENT": ("launcher", "`1` in the processes `llmwatch-instrument` starts: its `sitecustomize` "
                                        "arms the watch there (do not set it yourself)."),
    "LLMWATCH_POLICY": ("you", "`llmwatch-instrument`: the most the collector may do about the run (`auto`, "
                               "`shadow`, `off`) when `--policy` is not given; default `shadow`."),
    "LLMWATCH_RUN_ID_GENERATED": ("launcher", "`1` when `llmwatch-instrument` made the run id up: a rank under "
                                              "a multi-node torchrun then uses the rendezvous id instead."),
    "LLMWATCH_NODE": ("trainer", "Set for the `--on-isolate` command: the node being isolated. Read by "
                      "`python -m trainer.preflight` as this host's node name (default: the hostname)."),
    "LLMWATCH_REASON": ("trainer", "Set for the `--on-isolate` command: why."),
    "RANK": ("torchrun", "The process's global rank; with `WORLD_SIZE` and `LOCAL_RANK` it means \"running "
             "under torchrun\" (no embedded launcher)."),
    "WORLD_SIZE": ("torchrun", "The number of ranks."),
    "LOCAL_RANK": ("torchrun", "The rank's index on its node."),
    "LOCAL_WORLD_SIZE": ("torchrun", "Ranks per node."),
    "TORCHELASTIC_RUN_ID": ("torchrun", "torchrun's `--rdzv-id`: the run id when `--run-id` is not given."),
    "TORCHELASTIC_RESTART_COUNT": ("torchrun", "The elastic agent's restart count (the rank's incarnation)."),
    "TORCHELASTIC_USE_AGENT_STORE": ("torchrun", "`False` when the agents were started with "
                                     "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (what standby agents need): the "
                                     "workers' store is new each round, and the ranks agree on the restart "
                                     "round through it (a standby agent has restarted nothing)."),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": ("you", "torch's older name of `TORCH_FR_BUFFER_SIZE`, the Flight Recorder's "
                                            "entries per process: `llmwatch-instrument` sets the newer one only "
                                            "when neither is set (agent/flight.py)."),
    "PYTHONPATH": ("launcher", "`llmwatch-instrument` puts its `sitecustomize` folder first, before yours."),
    "OMP_NUM_THREADS": ("you", "Threads per rank for torch on CPU (the embedded launcher sets it from the "
                        "cores per rank unless you did)."),
    "POLARS_MAX_THREADS": ("you", "Threads of polars' pool. The embedded collector and dashboard run with 1 "
                           "unless you set it: they share the ranks' cores (trainer/embedded.py)."),
}
_ENV_NAME = re.compile(r"(LLMWATCH|TORCHELASTIC)_[A-Z0-9_]+")


def _escape(text: str) -> str:
    """A table cell: one line, pipes escaped, `<` kept from opening an HTML tag
    (outside code spans, where an entity would show literally)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts)


def _code(value: Any) -> str:
    text = repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= _MiB and value % _MiB == 0:
        return f"`{text}` ({value // _MiB} MiB)"
    return f"`{text}`"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in rows]
    return out


# --- flags -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Flag:
    """One argparse action, as the docs show it."""

    command: str  # "collector serve"
    group: str  # the argument group's title
    names: tuple[str, ...]  # ("--db",) or ("QUERY",) for a positional
    dest: str
    default: str  # markdown
    required: bool
    choices: tuple[str, ...]
    help: str
    repeatable: bool
    metavar: str


def _help_text(action: argparse.Action, prog: str) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = dict(vars(action), prog=prog)
    params = {k: (getattr(v, "__name__", v) if k == "type" else v) for k, v in params.items()}
    try:
        return action.help % params  # what argparse's formatter shows (%(default)s, %%)
    except (KeyError, TypeError, ValueError):
        return action.help


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices:
        return ""
    if action.type is not None:
        return getattr(action.type, "__name__", "VALUE").upper()
    return action.dest.upper()  # what argparse's usage line shows


def _flag_default(action: argparse.Action, fallback: Callable[[str], str | None] | None) -> str:
    if action.default is argparse.SUPPRESS or (action.default is None and fallback is not None):
        found = fallback(action.dest) if fallback is not None else None
        return found if found is not None else "(not set)"
    return _code(action.default)


def _parser_groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, list[argparse.Action]]]:
    """(title, description, actions) of each argument group, in the order made; argparse's
    two untitled groups (positionals, options) are one, "arguments", positionals first."""
    plain: list[argparse.Action] = []
    titled = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                   and a.help != argparse.SUPPRESS]
        if group.title in _UNTITLED:
            plain += actions
        elif actions:
            titled.append((group.title, group.description or "", actions))
    if plain:
        yield "arguments", "", sorted(plain, key=lambda a: bool(a.option_strings))
    yield from titled


def walk(parser: argparse.ArgumentParser, command: str,
         fallback: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(command, parser, its help) for `parser` and every subcommand under it, depth first."""
    yield command, parser, parser.description or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                for cmd, p, h in walk(sub, f"{command} {name}", fallback):
                    yield cmd, p, (helps.get(name, h) if p is sub else h)


def flags_of(parser: argparse.ArgumentParser, command: str,
             fallback: Callable[[str], str | None] | None = None) -> list[Flag]:
    """Every flag and positional of `parser` itself (not of its subcommands)."""
    out = []
    for title, _, actions in _parser_groups(parser):
        for a in actions:
            out.append(Flag(command=command, group=title,
                            names=tuple(a.option_strings) or ((a.metavar or a.dest).upper(),), dest=a.dest,
                            default="**required**" if a.required else _flag_default(a, fallback),
                            required=bool(a.required), choices=tuple(str(c) for c in a.choices or ()),
                            help=_help_text(a, parser.prog),
                            repeatable=isinstance(a, (argparse._AppendAction, argparse._AppendConstAction,
                                                      argparse._CountAction)),
                            metavar=_metavar(a)))
    return out


def _flag_cell(f: Flag) -> str:
    name = ", ".join(f"`{n}`" for n in f.names)
    if f.metavar and f.names[0].startswith("-"):
        name = ", ".join(f"`{n} {f.metavar}`" for n in f.names)
    if not f.names[0].startswith("-"):
        name += " (positional)"
    return name + (" (repeatable)" if f.repeatable else "")


def _trainer_defaults() -> Callable[[str], str | None]:
    """A `trainer` flag's dest -> the `JobConfig` default it overrides, as markdown."""
    from trainer import cli
    from trainer.config import JobConfig

    cfg = JobConfig()

    def default(dest: str) -> str | None:
        if dest in cli._MAP:
            part, name = cli._MAP[dest]
            return f"{_code(getattr(getattr(cfg, part), name))} (`{part}.{name}`)"
        if dest in cli._TOP or dest == "inject":
            return f"{_code(getattr(cfg, dest))} (`{dest}`)"
        return None

    return default


_FALLBACKS: dict[str, Callable[[], Callable[[str], str | None]]] = {"trainer": _trainer_defaults}


def all_flags() -> list[Flag]:
    """Every flag of every CLI, every subcommand included."""
    out = []
    for command, module in CLIS:
        fallback = _FALLBACKS[command]() if command in _FALLBACKS else None
        for cmd, parser, _ in walk(importlib.import_module(module).build_parser(), command, fallback):
            out += flags_of(parser, cmd, fallback)
    return out


def _exclusive_notes(parser: argparse.ArgumentParser) -> list[str]:
    notes = []
    for g in parser._mutually_exclusive_groups:
        names = ", ".join(f"`{a.option_strings[0] if a.option_strings else a.dest}`" for a in g._group_actions)
        notes.append(f"{'Exactly' if g.required else 'At most'} one of {names}.")
    return notes


def flags_table(flags: list[Flag]) -> list[str]:
    """One table; a choices column only where some flag has choices."""
    with_choices = any(f.choices for f in flags)
    header = ["flag", "default"] + (["choices"] if with_choices else []) + ["help"]
    return _table(header, [[_flag_cell(f), f.default] + ([", ".join(f"`{c}`" for c in f.choices)] if with_choices
                                                        else []) + [f.help] for f in flags])


def cli_block(command: str, module: str) -> list[str]:
    parser = importlib.import_module(module).build_parser()
    fallback = _FALLBACKS[command]() if command in _FALLBACKS else None
    lines: list[str] = []
    for cmd, p, help_text in walk(parser, command, fallback):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        lines += [f"### `{cmd}`", ""]
        if help_text:
            lines += [_escape(help_text.strip().split("\n\n")[0]), ""]
        if subs:
            lines += ["Subcommands: " + ", ".join(f"`{cmd} {n}`" for s in subs for n in s.choices) + ".", ""]
        flags = flags_of(p, cmd, fallback)
        for title, description, _ in _parser_groups(p):
            if title != "arguments" or description:
                lines += [f"**{_escape(title)}**" + (f": {_escape(description)}" if description else ""), ""]
            lines += flags_table([f for f in flags if f.group == title]) + [""]
        notes = _exclusive_notes(p)
        lines += notes + ([""] if notes else [])
    return lines[:-1] if lines and lines[-1] == "" else lines


# --- rules ---------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return repr(value)


def _by_section(text: str, section_re: str, row_re: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the text `row_re` captures after the key, on the lines under each
    line `section_re` matches."""
    out, section = {}, ""
    for line in text.splitlines():
        m = re.match(section_re, line)
        if m:
            section = m.group(1)
            continue
        m = re.match(row_re, line)
        if m and section:
            out[(section, m.group(1))] = m.group(2).strip()
    return out


def _toml_comments(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment on its line in rules.toml."""
    return _by_section(text, r"\s*\[([A-Za-z0-9_]+)\]\s*$", r"\s*([A-Za-z0-9_]+)\s*=.*?\s#\s?(.*)$")


def _rules_doc_meanings(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the meaning column of its row in docs/rules.md."""
    return _by_section(text, r"##\s+\[([A-Za-z0-9_]+)\]", r"\|\s*`([A-Za-z0-9_]+)`\s*\|[^|]*\|\s*(.*?)\s*\|\s*$")


def rules_keys() -> dict[str, dict[str, Any]]:
    """section -> key -> default, as `analysis.rules.load_rules()` has them."""
    from analysis.rules import load_rules

    return load_rules().as_dict()


def _type_name(value: Any) -> str:
    if isinstance(value, list):
        return "list of strings"
    return {bool: "bool", int: "int", float: "float", str: "string"}[type(value)]


def rules_block() -> list[str]:
    from analysis.rules import default_rules_text

    comments = _toml_comments(default_rules_text())
    documented = _rules_doc_meanings(RULES_DOC.read_text()) if RULES_DOC.exists() else {}
    lines: list[str] = []
    for section, keys in rules_keys().items():
        lines += [f"### `[{section}]`", "", f"docs/rules.md: [`[{section}]`](rules.md#{section}).", ""]
        rows = []
        for key, value in keys.items():
            meaning = comments.get((section, key)) or documented.get((section, key), "")
            rows.append([f"`{key}`", f"`{_toml_value(value)}`", _type_name(value), meaning])
        lines += _table(["key", "default", "type", "meaning"], rows) + [""]
    return lines[:-1]


# --- environment -------------------------------------------------------------------------

def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("environ", "env")) or \
        (isinstance(node, ast.Attribute) and node.attr == "environ")


def env_uses(root: Path = ROOT) -> dict[str, set[str]]:
    """Environment variable name -> the source files (relative paths) that name it: as a
    `LLMWATCH_*`/`TORCHELASTIC_*` string or keyword, or as a constant read through
    `environ[...]`, `environ.get(...)` or `os.getenv(...)`."""
    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV_NAME.fullmatch(node.value):
                    names.append(node.value)
                elif isinstance(node, ast.keyword) and node.arg and _ENV_NAME.fullmatch(node.arg):
                    names.append(node.arg)
                elif isinstance(node, ast.JoinedStr):  # f"LLMWATCH_{role.name}_TOKEN"
                    head = node.values[0] if node.values else None
                    if isinstance(head, ast.Constant) and str(head.value).startswith("LLMWATCH_"):
                        names += [n for n in ENV_VARS if re.fullmatch(
                            "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "[A-Z]+"
                                    for v in node.values), n)]
                elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                    if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                        names.append(node.slice.value)
                elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                        and isinstance(node.args[0].value, str):
                    f = node.func
                    if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault")
                            and _is_environ(f.value)) or (isinstance(f, ast.Attribute) and f.attr == "getenv"):
                        names.append(node.args[0].value)
                for name in names:
                    out.setdefault(name, set()).add(rel)
    return out


_SETTER = {"you": "you", "launcher": "the launcher (internal)", "torchrun": "torchrun", "trainer": "the trainer"}


def env_block() -> list[str]:
    uses = env_uses()
    rows = []
    order = list(_SETTER)
    for name in sorted(uses, key=lambda n: (order.index(ENV_VARS[n][0]) if n in ENV_VARS else -1, n)):
        setter, meaning = ENV_VARS.get(name, ("?", "UNDOCUMENTED: describe it in tests/config_reference.py"))
        rows.append([f"`{name}`", _SETTER.get(setter, setter), meaning,
                     ", ".join(f"`{p}`" for p in sorted(uses[name]))])
    return _table(["variable", "set by", "meaning", "named in"], rows)


# --- the schema version (docs/operations.md) ------------------------------------------------

def schema_block() -> list[str]:
    from collector.store.schema import MIGRATIONS

    versions = sorted(v for v, _ in MIGRATIONS)
    return [f"This collector's schema version is **{versions[-1]}** (`collector/store/schema.py` `MIGRATIONS`: "
            f"versions {', '.join(map(str, versions))})."]


# --- pages ---------------------------------------------------------------------------------

def blocks() -> dict[Path, dict[str, Callable[[], list[str]]]]:
    page: dict[str, Callable[[], list[str]]] = {
        f"flags:{command}": (lambda c=command, m=module: cli_block(c, m)) for command, module in CLIS}
    page["rules"] = rules_block
    page["env"] = env_block
    return {CONFIGURATION: page, OPERATIONS: {"schema-version": schema_block}}


def render(text: str, generators: dict[str, Callable[[], list[str]]], *, name: str = "page") -> str:
    """`text` with each named block's body regenerated. A marker that is missing,
    doubled or unknown is an error (a block is never silently added or dropped)."""
    found = re.findall(r"<!-- BEGIN GENERATED: (\S+) -->", text)
    unknown = sorted(set(found) - set(generators))
    if unknown:
        raise ValueError(f"{name}: unknown generated block(s) {unknown} (known: {sorted(generators)})")
    for block, generate in generators.items():
        begin, end = _BEGIN.format(block), _END.format(block)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise ValueError(f"{name}: needs exactly one {begin} ... {end} pair")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n" + "\n".join(generate()) + "\n" + end + tail
    return text


def drift() -> dict[Path, str]:
    """Page -> the unified diff from what is on disk to what it should be (only pages that drifted)."""
    out = {}
    for path, generators in blocks().items():
        current = path.read_text()
        wanted = render(current, generators, name=path.name)
        if wanted != current:
            rel = str(path.relative_to(ROOT))
            out[path] = "".join(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                     f"{rel} (on disk)", f"{rel} (generated)"))
    return out


def write() -> list[Path]:
    changed = []
    for path, generators in blocks().items():
        current = path.read_text()
        wanted = render(current, generators, name=path.name)
        if wanted != current:
            path.write_text(wanted)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.config_reference", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff when a page drifted")
    args = p.parse_args(argv)
    if args.write:
        changed = write()
        print("rewrote " + ", ".join(str(c.relative_to(ROOT)) for c in changed) if changed else "up to date")
        return 0
    diffs = drift()
    for diff in diffs.values():
        sys.stdout.write(diff)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())

"""Bearer tokens by role, where they come from, and which role each route needs.

Three roles, so that a leaked dashboard token cannot stop a run:

    ingest   the ranks' agents: POST /v1/ingest, POST /v1/metrics (OTLP)
    read     dashboards, SQL, Prometheus: GET /v1/..., POST /v1/sql, GET /metrics,
             GET /openapi.json
    control  issuing commands: POST /v1/runs/{run}/commands (a control token
             may also read: whoever may stop a run may see it)

A token given without a role (`--token-file`, `$LLMWATCH_TOKEN`, `--token`) has
every role: the quick start of a single-user run keeps working.

Secrets come from files (0600) or the environment, never from a config file,
and never reach a table, a log line or an error message. In memory only their
SHA-256 digests are kept; a check hashes the presented token and compares it
with every digest of the role in constant time, so the time taken says nothing
about how much of a token was right.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent import secrets as secrets_io

log = logging.getLogger("collector.http.auth")


class Role(str, enum.Enum):
    INGEST = "ingest"
    READ = "read"
    CONTROL = "control"


ROLES = tuple(Role)
# Which roles a token of each role grants.
_GRANTS = {Role.INGEST: {Role.INGEST}, Role.READ: {Role.READ}, Role.CONTROL: {Role.CONTROL, Role.READ}}
ALL_ROLES_ENV = "LLMWATCH_TOKEN"
ROLE_ENV = {role: f"LLMWATCH_{role.name}_TOKEN" for role in ROLES}
MIN_STRONG_CHARS = 16
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a header can carry


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


@dataclass(frozen=True, slots=True)
class Tokens:
    """The digests of the tokens each role accepts."""

    digests: Mapping[Role, tuple[bytes, ...]] = field(default_factory=dict)

    @classmethod
    def build(cls, *, all_roles: Iterable[str] = (), by_role: Mapping[Role, Iterable[str]] | None = None) -> "Tokens":
        """`all_roles`: tokens with every role; `by_role`: tokens of one role each."""
        out: dict[Role, list[bytes]] = {role: [] for role in ROLES}
        for token in all_roles:
            for role in ROLES:
                out[role].append(_digest(_check_token(token)))
        for role, tokens in (by_role or {}).items():
            for token in tokens:
                for granted in _GRANTS[Role(role)]:
                    out[granted].append(_digest(_check_token(token)))
        return cls({role: tuple(dict.fromkeys(d)) for role, d in out.items()})

    @property
    def empty(self) -> bool:
        return not any(self.digests.values())

    def roles_of(self, authorization: bytes | str | None) -> frozenset[Role]:
        """The roles the `Authorization: Bearer <token>` header grants (empty: none)."""
        if not authorization:
            return frozenset()
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        scheme, _, given = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return frozenset()
        presented = _digest(given.strip())
        granted = set()
        for role, digests in self.digests.items():
            ok = False
            for d in digests:  # every digest is compared: no early exit
                ok |= hmac.compare_digest(presented, d)
            if ok:
                granted.add(role)
        return frozenset(granted)

    def allows(self, authorization: bytes | str | None, role: Role) -> bool:
        return role in self.roles_of(authorization)


def _check_token(token: str) -> bytes:
    token = token.strip()
    if not _TOKEN_CHARS.fullmatch(token):
        raise ValueError("a token must be printable ASCII characters without spaces")
    if len(token) < MIN_STRONG_CHARS:
        log.warning("a token of %d characters is easy to guess: use %d or more (e.g. from `openssl rand -hex 24`)",
                    len(token), MIN_STRONG_CHARS)
    return token.encode("ascii")


def read_token_file(path: str | Path) -> str:
    """The token in `path` (first line; `agent.secrets`). Warns when others may read the file."""
    token = secrets_io.read_token_file(path)
    st = Path(path).stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) and not stat.S_ISFIFO(st.st_mode):
        log.warning("token file %s is readable by others (mode %o): chmod 600 it", path, stat.S_IMODE(st.st_mode))
    return token


def write_secret_file(path: str | Path, text: str) -> Path:
    """Write `text` to `path` with mode 0600 (`agent.secrets`), in a directory made
    0700 when this creates it."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return secrets_io.write_secret(path, text)


def generate_role_tokens(directory: str | Path) -> dict[Role, Path]:
    """Ensure `directory` (0700) holds one 0600 token file per role, named after the
    role; existing files are kept (a restarted collector keeps its agents' tokens)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    paths = {}
    for role in ROLES:
        path = directory / role.value
        if path.exists():
            os.chmod(path, 0o600)
        else:
            write_secret_file(path, secrets.token_urlsafe(32))
        paths[role] = path
    return paths


@dataclass(slots=True)
class TokenSources:
    """What a command line and the environment say about tokens."""

    token: str | None = None  # --token (every role; visible in `ps`: prefer the file or env)
    token_file: str | None = None  # --token-file (every role)
    role_files: dict[Role, str] = field(default_factory=dict)  # --ingest-token-file ...

    def resolve(self, environ: Mapping[str, str], *, default_dir: Path | None = None) -> tuple[Tokens, str]:
        """The tokens, and one line saying where they came from (no secret in it).
        With no source at all and a `default_dir`, role tokens are generated there."""
        all_roles = [t for t in (self.token, environ.get(ALL_ROLES_ENV)) if t]
        where = []
        if self.token:
            where.append("--token")
        if environ.get(ALL_ROLES_ENV):
            where.append(f"${ALL_ROLES_ENV}")
        if self.token_file:
            all_roles.append(read_token_file(self.token_file))
            where.append(f"--token-file {self.token_file}")
        by_role: dict[Role, list[str]] = {role: [] for role in ROLES}
        for role in ROLES:
            if role in self.role_files:
                by_role[role].append(read_token_file(self.role_files[role]))
                where.append(f"{role.value} token {self.role_files[role]}")
            if environ.get(ROLE_ENV[role]):
                by_role[role].append(environ[ROLE_ENV[role]])
                where.append(f"${ROLE_ENV[role]}")
        if not where and default_dir is not None:
            paths = generate_role_tokens(default_dir)
            for role, path in paths.items():
                by_role[role].append(read_token_file(path))
            where.append(f"role tokens in {default_dir}/{{ingest,read,control}}")
        tokens = Tokens.build(all_roles=all_roles, by_role=by_role)
        if tokens.empty:
            raise ValueError("no token given: use --token-file, $LLMWATCH_TOKEN or the --<role>-token-file flags")
        return tokens, ", ".join(where)


def client_token(*, token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """A client's token: --token-file, else --token, else $LLMWATCH_TOKEN ('' if none)."""
    if token_file:
        return read_token_file(token_file)
    return token or environ.get(ALL_ROLES_ENV, "")

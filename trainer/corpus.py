"""The training corpus: real text this machine already has, tokenized, cut into samples.

Two domains, no downloads:

- "code": the Python standard library's `.py` sources (test packages and
  site-packages left out), files in sorted relative-path order up to a size cap;
- "math": arithmetic generated from a seeded numpy Generator (`37+485=522`,
  `(12+7)*3=57`, worked multi-step chains).

Every source document (a file, a block of arithmetic lines) ends with EOS and is
cut at line boundaries into samples of `min_sample_tokens..seq_len+1` tokens,
each starting with BOS; the target lengths are drawn at random so that the
samples really vary in length (which is what length grouping is for). A line
longer than a sample is cut mid-line; a document's tail shorter than a sample
is dropped.

The result is one flat uint16 token array plus sample offsets and a domain id
per sample, cached as `.npy` under `<cache root>/corpus-<key>` where the key
covers the source files (path, size, mtime), the sample geometry and the seed.
A full build (~8 MB code + ~3 MB math, ~25 MB cached) takes ~0.6 s here;
loading the cache memory-maps it, so ranks on one machine share the pages. Ranks
that start together may all build: each writes a private temporary directory and
renames it into place; the loser of the rename discards its copy.

`data_version` is a short sha256 of the samples (tokens, boundaries, domains):
equal versions mean the same data, whatever machine built it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import sysconfig
import time
import uuid
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.config import DataConfig
from trainer.tokenizer import BOS, EOS

FORMAT_VERSION = 1  # bump when the build changes what a cache directory holds
CODE_BYTES = 8 * 1024 * 1024
MATH_BYTES = 3 * 1024 * 1024
KNOWN_DOMAINS = ("code", "math")
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DEFAULT_CACHE_ROOT = "~/.cache/llmwatch"
_NEWLINE = ord("\n")
_SALT = {"code": 1, "math": 2, "eval": 3}  # keeps the random streams of the build apart


@dataclass(frozen=True, slots=True)
class SourceFile:
    relpath: str
    path: str
    nbytes: int
    mtime_ns: int


def stdlib_sources(root: str | os.PathLike | None = None, *, max_bytes: int = CODE_BYTES) -> list[SourceFile]:
    """The `.py` files under `root` (default: this interpreter's stdlib) in sorted
    relative-path order, the longest prefix of that order within `max_bytes`.
    Directories in SKIP_DIRS are not entered. Costs one stat per file (~2k)."""
    root = os.fspath(root if root is not None else sysconfig.get_paths()["stdlib"])
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                found.append(SourceFile(rel, path, st.st_size, st.st_mtime_ns))
    found.sort(key=lambda f: f.relpath)
    picked: list[SourceFile] = []
    total = 0
    for f in found:
        if total + f.nbytes > max_bytes:
            break
        picked.append(f)
        total += f.nbytes
    return picked


def _code_documents(files: list[SourceFile]) -> tuple[list[bytes], dict]:
    docs: list[bytes] = []
    skipped = 0
    for f in files:
        try:
            data = Path(f.path).read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if data.strip():
            docs.append(data)
    return docs, {"num_files": len(docs), "num_files_skipped": skipped}


def _math_lines(rng: np.random.Generator, n: int) -> list[str]:
    kinds = rng.integers(0, 9, n).tolist()
    a = rng.integers(0, 1000, n).tolist()
    b = rng.integers(0, 1000, n).tolist()
    c = rng.integers(0, 100, n).tolist()
    d = rng.integers(1, 100, n).tolist()
    lines = []
    for k, x, y, z, w in zip(kinds, a, b, c, d):
        if k == 0:
            lines.append(f"{x}+{y}={x + y}\n")
        elif k == 1:
            lines.append(f"{x}-{y}={x - y}\n")
        elif k == 2:
            lines.append(f"{x}*{z}={x * z}\n")
        elif k == 3:
            lines.append(f"{x}+{y}*{z}={x + y * z}\n")
        elif k == 4:
            lines.append(f"({x}+{y})*{z}={(x + y) * z}\n")
        elif k == 5:
            lines.append(f"{x}*{z}-{y}={x * z - y}\n")
        elif k == 6:
            lines.append(f"{x}//{w}={x // w}\n")
        elif k == 7:
            lines.append(f"{x}%{w}={x % w}\n")
        else:  # a worked chain: the multi-step expression, then each step
            s = x + y
            p = s * z
            lines.append(f"({x}+{y})*{z}-{w}: {x}+{y}={s}, {s}*{z}={p}, {p}-{w}={p - w}\n")
    return lines


def _math_documents(rng: np.random.Generator, nbytes: int) -> tuple[list[bytes], dict]:
    """Blocks of 8..63 arithmetic lines until `nbytes` of text exist."""
    docs: list[bytes] = []
    total = num_lines = 0
    while total < nbytes:
        sizes = rng.integers(8, 64, 256).tolist()
        lines = _math_lines(rng, sum(sizes))
        at = 0
        for size in sizes:
            doc = "".join(lines[at:at + size]).encode()
            at += size
            docs.append(doc)
            total += len(doc)
            num_lines += size
            if total >= nbytes:
                break
    return docs, {"num_lines": num_lines}


def _cut_documents(docs: list[bytes], rng: np.random.Generator, *, min_tokens: int,
                   seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat stream of `docs` (each + EOS) and the [start, end) of each sample's body.

    A sample ends at the last line end within a drawn target length, or at the
    first one after it when that still fits; only a line longer than a sample is
    cut inside. The body excludes the BOS the sample gets in front, so a body
    holds `min_tokens-1 .. seq_len` tokens. Python loop over samples: ~2 µs each."""
    stream = np.concatenate([part for doc in docs
                             for part in (np.frombuffer(doc, np.uint8).astype(np.uint16),
                                          np.array([EOS], np.uint16))]) if docs else np.zeros(0, np.uint16)
    cuts = (np.flatnonzero((stream == _NEWLINE) | (stream == EOS)) + 1).tolist()  # line and document ends
    min_body = min_tokens - 1
    targets: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    doc_end = 0
    for doc in docs:
        pos, doc_end = doc_end, doc_end + len(doc) + 1
        while doc_end - pos >= min_body:
            if not targets:
                targets = rng.integers(min_body, seq_len + 1, 4096).tolist()
            limit = min(pos + targets.pop(), doc_end)
            i = bisect_right(cuts, limit) - 1  # the last line end within the drawn length...
            if i >= 0 and cuts[i] - pos >= min_body:
                end = cuts[i]
            elif cuts[i + 1] - pos <= seq_len:  # ...or else the next one, if a sample can hold it
                end = cuts[i + 1]
            else:  # a line longer than a sample
                end = limit
            starts.append(pos)
            ends.append(end)
            pos = end
    return stream, np.asarray(starts, np.int64), np.asarray(ends, np.int64)


def _assemble(stream: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat tokens with a BOS before each body, and the sample offsets."""
    body = ends - starts
    offsets = np.concatenate([[0], np.cumsum(body + 1)]).astype(np.int64)
    tokens = np.empty(int(offsets[-1]), np.uint16)
    tokens[offsets[:-1]] = BOS
    is_body = np.ones(len(tokens), bool)
    is_body[offsets[:-1]] = False
    positions = np.flatnonzero(is_body)
    tokens[positions] = stream[positions + np.repeat(starts - offsets[:-1] - 1, body)]
    return tokens, offsets


def content_version(tokens: np.ndarray, offsets: np.ndarray, domain_ids: np.ndarray, domains) -> str:
    """Short sha256 of the samples; ~20 ms for a full corpus."""
    h = hashlib.sha256(json.dumps(list(domains)).encode())
    for arr, dtype in ((tokens, np.uint16), (offsets, np.int64), (domain_ids, np.uint8)):
        h.update(np.ascontiguousarray(arr, dtype=dtype).tobytes())
    return h.hexdigest()[:12]


class Corpus:
    """All samples of all domains in one flat token array, and the held-out split.

    `tokens` is uint16 (memory-mapped when loaded from the cache); sample `i` is
    `tokens[offsets[i]:offsets[i+1]]`. Per domain, `eval_samples` samples chosen
    with the build seed are held out (`eval_ids`); `train_ids` are all others."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, domain_ids: np.ndarray, *,
                 domains: tuple[str, ...], seq_len: int, seed: int, eval_samples: int,
                 source_stats: dict | None = None, data_version: str | None = None,
                 path: Path | None = None, build_s: float = 0.0, from_cache: bool = False) -> None:
        self.tokens = tokens
        self.offsets = np.asarray(offsets, np.int64)
        self.domain_ids = np.asarray(domain_ids, np.uint8)
        self.lengths = np.diff(self.offsets)
        self.domains = tuple(domains)
        self.seq_len = seq_len
        self.seed = seed
        self.path = path
        self.build_s = build_s  # seconds the build took (in whichever process built it)
        self.from_cache = from_cache  # True when this process found the build already there
        self._source_stats = source_stats or {}
        if len(self.domain_ids) != len(self.lengths):
            raise ValueError(f"{len(self.domain_ids)} domain ids for {len(self.lengths)} samples")
        if len(self.lengths) and int(self.lengths.max()) > seq_len + 1:
            raise ValueError(f"a sample of {int(self.lengths.max())} tokens is longer than seq_len+1={seq_len + 1}")
        self.data_version = data_version or content_version(self.tokens, self.offsets, self.domain_ids, self.domains)
        self.eval_ids: dict[str, np.ndarray] = {}
        held_out = np.zeros(len(self.lengths), bool)
        for k, name in enumerate(self.domains):
            ids = np.flatnonzero(self.domain_ids == k)
            if len(ids) <= eval_samples:
                raise ValueError(f"domain {name!r} has {len(ids)} samples, not more than eval_samples={eval_samples}")
            rng = np.random.default_rng([seed, _SALT["eval"], k])
            self.eval_ids[name] = np.sort(rng.choice(ids, eval_samples, replace=False))
            held_out[self.eval_ids[name]] = True
        self.train_ids = np.flatnonzero(~held_out)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> np.ndarray:
        """Tokens of sample `i` (a view; BOS first)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def stats(self) -> dict[str, dict]:
        """Per domain: sample and token counts, length range, train/eval split, and
        what the source was (files, lines, bytes)."""
        out: dict[str, dict] = {}
        train = np.zeros(len(self.lengths), bool)
        train[self.train_ids] = True
        for k, name in enumerate(self.domains):
            mask = self.domain_ids == k
            lens = self.lengths[mask]
            out[name] = {
                "num_samples": int(mask.sum()),
                "num_train": int((mask & train).sum()),
                "num_eval": len(self.eval_ids[name]),
                "num_tokens": int(lens.sum()),
                "mean_sample_tokens": round(float(lens.mean()), 2),
                "min_sample_tokens": int(lens.min()),
                "max_sample_tokens": int(lens.max()),
                **self._source_stats.get(name, {}),
            }
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, eval_samples: int, from_cache: bool = True) -> "Corpus":
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: corpus format {meta.get('format')} is not {FORMAT_VERSION}; delete it")
        return cls(np.load(path / "tokens.npy", mmap_mode="r"), np.load(path / "offsets.npy"),
                   np.load(path / "domain_ids.npy"), domains=tuple(meta["domains"]), seq_len=meta["seq_len"],
                   seed=meta["seed"], eval_samples=eval_samples, source_stats=meta["source_stats"],
                   data_version=meta["data_version"], path=path, build_s=meta["build_s"], from_cache=from_cache)


def _check_geometry(data: DataConfig, seq_len: int) -> None:
    unknown = [d for d in data.domains if d not in KNOWN_DOMAINS]
    if unknown or not data.domains or len(set(data.domains)) != len(data.domains):
        raise ValueError(f"domains {data.domains!r}: each must be one of {KNOWN_DOMAINS}, without repeats")
    if not 2 <= data.min_sample_tokens <= seq_len + 1:
        raise ValueError(f"min_sample_tokens {data.min_sample_tokens} must be in [2, seq_len+1={seq_len + 1}]")


def _cache_key(files: list[SourceFile], data: DataConfig, *, seq_len: int, seed: int,
               max_code_bytes: int, math_bytes: int) -> str:
    spec = {
        "format": FORMAT_VERSION, "domains": list(data.domains), "seq_len": seq_len,
        "min_sample_tokens": data.min_sample_tokens, "seed": seed, "max_code_bytes": max_code_bytes,
        "math_bytes": math_bytes, "files": [[f.relpath, f.nbytes, f.mtime_ns] for f in files],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _build(final: Path, files: list[SourceFile], data: DataConfig, *, seq_len: int, seed: int,
           math_bytes: int) -> None:
    t0 = time.perf_counter()
    parts_tokens, parts_offsets, parts_domains = [], [], []
    source_stats: dict[str, dict] = {}
    base = 0
    for k, name in enumerate(data.domains):
        rng = np.random.default_rng([seed, _SALT[name]])
        docs, info = _code_documents(files) if name == "code" else _math_documents(rng, math_bytes)
        stream, starts, ends = _cut_documents(docs, rng, min_tokens=data.min_sample_tokens, seq_len=seq_len)
        tokens, offsets = _assemble(stream, starts, ends)
        source_stats[name] = {**info, "num_docs": len(docs), "source_bytes": sum(map(len, docs))}
        parts_tokens.append(tokens)
        parts_offsets.append(offsets[:-1] + base)
        parts_domains.append(np.full(len(starts), k, np.uint8))
        base += len(tokens)
    tokens = np.concatenate(parts_tokens)
    offsets = np.concatenate(parts_offsets + [np.array([base], np.int64)])
    domain_ids = np.concatenate(parts_domains)
    meta = {
        "format": FORMAT_VERSION, "domains": list(data.domains), "seq_len": seq_len, "seed": seed,
        "min_sample_tokens": data.min_sample_tokens, "source_stats": source_stats,
        "data_version": content_version(tokens, offsets, domain_ids, data.domains),
        "num_samples": len(domain_ids), "num_tokens": len(tokens),
        "build_s": round(time.perf_counter() - t0, 3),
    }
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "offsets.npy", offsets)
        np.save(tmp / "domain_ids.npy", domain_ids)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, final)  # atomic; fails when another rank's build got there first
    except OSError:
        if not (final / "meta.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_corpus(data: DataConfig, *, seq_len: int, seed: int, max_code_bytes: int = CODE_BYTES,
                 math_bytes: int = MATH_BYTES, code_root: str | os.PathLike | None = None) -> Corpus:
    """The corpus for this configuration: from the cache, or built and cached.

    `max_code_bytes` / `math_bytes` size the two domains (tests pass small ones);
    `code_root` replaces the stdlib directory (tests). Safe to call from every rank
    at once."""
    _check_geometry(data, seq_len)
    files = stdlib_sources(code_root, max_bytes=max_code_bytes) if "code" in data.domains else []
    key = _cache_key(files, data, seq_len=seq_len, seed=seed, max_code_bytes=max_code_bytes, math_bytes=math_bytes)
    final = Path(data.cache_dir or DEFAULT_CACHE_ROOT).expanduser() / f"corpus-{key}"
    from_cache = (final / "meta.json").exists()
    if not from_cache:
        _build(final, files, data, seq_len=seq_len, seed=seed, math_bytes=math_bytes)
    return Corpus.load(final, eval_samples=data.eval_samples, from_cache=from_cache)


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.corpus`: build (or find) the corpus and print its stats."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    corpus = build_corpus(DataConfig(cache_dir=args.cache_dir), seq_len=args.seq_len, seed=args.seed)
    print(json.dumps({
        "path": str(corpus.path), "data_version": corpus.data_version, "from_cache": corpus.from_cache,
        "build_s": corpus.build_s, "call_s": round(time.perf_counter() - t0, 3),
        "num_samples": len(corpus), "num_tokens": int(corpus.offsets[-1]),
        "cache_bytes": sum(p.stat().st_size for p in corpus.path.iterdir()), "domains": corpus.stats(),
    }, indent=1))


if __name__ == "__main__":
    main()

"""Byte-level tokenizer: ids 0..255 are the bytes of UTF-8 text, then three specials.

Built locally with no vocabulary file and nothing to train: any text round-trips
exactly, and one byte is one token, so tokenizing a corpus is a `frombuffer`.
The model pads the embedding to `ModelConfig.vocab_size` (320) so it splits evenly
over tensor-parallel ranks; the ids 259..319 are simply never produced.
"""

from __future__ import annotations

import numpy as np

BOS = 256  # begins every sample
EOS = 257  # ends every source document
PAD = 258  # input padding; targets are padded with IGNORE_INDEX instead
VOCAB_SIZE = 259
SPECIAL_NAMES = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>"}


def encode(text: str | bytes, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """Token ids (int32) of `text`, optionally framed by BOS / EOS."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    body = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    if not (bos or eos):
        return body
    parts = [np.array([BOS], np.int32)] if bos else []
    parts.append(body)
    if eos:
        parts.append(np.array([EOS], np.int32))
    return np.concatenate(parts)


def decode(ids, *, specials: bool = False, errors: str = "replace") -> str:
    """Text of `ids` (any int sequence: list, numpy array, CPU tensor).

    Byte ids are decoded as UTF-8 (invalid sequences per `errors`). Specials are
    dropped, or rendered as `<bos>` / `<eos>` / `<pad>` with `specials=True`; any
    other id (IGNORE_INDEX, the model's padded vocab) is dropped."""
    arr = np.asarray(ids, dtype=np.int64).ravel()
    if not specials:
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors)
    out: list[str] = []
    run: list[int] = []
    for tok in arr.tolist():
        if 0 <= tok < 256:
            run.append(tok)
            continue
        if tok in SPECIAL_NAMES:
            out.append(bytes(run).decode("utf-8", errors))
            run = []
            out.append(SPECIAL_NAMES[tok])
    out.append(bytes(run).decode("utf-8", errors))
    return "".join(out)

"""Byte-level tokenizer: ids 0..255 are UTF-8 bytes, plus two document markers.

Every byte sequence is representable, so encoding never drops or replaces
anything; only decoding (bytes -> str) may substitute U+FFFD for invalid UTF-8.
"""

from collections.abc import Iterable

import numpy as np

BOS = 256  # document start
EOS = 257  # document end
VOCAB_SIZE = 258


def _as_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    return bytes(text)


def encode(text: str | bytes) -> np.ndarray:
    """Returns the bytes of `text` (str is UTF-8 encoded) as int32 ids, shape [n]."""
    return np.frombuffer(_as_bytes(text), dtype=np.uint8).astype(np.int32)


def encode_document(text: str | bytes) -> np.ndarray:
    """Returns [BOS, bytes..., EOS] as int32 ids, shape [n + 2]."""
    body = _as_bytes(text)
    ids = np.empty(len(body) + 2, dtype=np.int32)
    ids[0] = BOS
    ids[1:-1] = np.frombuffer(body, dtype=np.uint8)
    ids[-1] = EOS
    return ids


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Returns the text of byte ids, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    body = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
    return body.tobytes().decode("utf-8", errors="replace")

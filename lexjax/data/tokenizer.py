"""Tokenizers: UTF-8 bytes, or SentencePiece pieces learned from the training text.

Both give the same small interface (:class:`Tokenizer`): ``encode`` /
``encode_document`` / ``decode``, ``vocab_size``, ``bos`` / ``eos``, and
``num_bytes(ids)``, the number of UTF-8 bytes of text a run of ids covers (the
denominator of bits per byte, so models with different tokenizers compare).
``to_json`` / :func:`from_json` carry a tokenizer inside a checkpoint;
``fingerprint`` tells two tokenizers apart.

Bytes: ids 0..255 are the bytes, then BOS and EOS. Every byte sequence is
representable, so encoding never drops or replaces anything; only decoding
(bytes -> str) may substitute U+FFFD for invalid UTF-8.

SentencePiece (:func:`train_sentencepiece`): a unigram model with byte
fallback and no normalization (no NFKC, no dummy prefix, whitespace kept), so
every string encodes and ``decode(encode(text)) == text`` exactly; the one
exception is a literal U+2581 (``▁``, SentencePiece's space marker), which
decodes as a space. Ids: 0 padding, 1 unknown (never produced: byte fallback),
2 BOS, 3 EOS, then 256 byte pieces and the learned pieces.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np

from lexjax.errors import DataError

KINDS = ("bytes", "sentencepiece")

BOS = 256  # byte tokenizer: document start
EOS = 257  # byte tokenizer: document end
VOCAB_SIZE = 258


def _as_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    return bytes(text)


def encode(text: str | bytes) -> np.ndarray:
    """Byte tokenizer: the bytes of `text` (str is UTF-8 encoded) as int32 ids, shape [n]."""
    return np.frombuffer(_as_bytes(text), dtype=np.uint8).astype(np.int32)


def encode_document(text: str | bytes) -> np.ndarray:
    """Byte tokenizer: [BOS, bytes..., EOS] as int32 ids, shape [n + 2]."""
    body = _as_bytes(text)
    ids = np.empty(len(body) + 2, dtype=np.int32)
    ids[0] = BOS
    ids[1:-1] = np.frombuffer(body, dtype=np.uint8)
    ids[-1] = EOS
    return ids


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Byte tokenizer: the text of byte ids, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    body = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
    return body.tobytes().decode("utf-8", errors="replace")


class Tokenizer:
    """What every tokenizer offers; pure (no state changes after construction).

    Subclasses set ``kind``, ``vocab_size``, ``bos``, ``eos`` and the int64
    table ``_bytes_per_id`` [vocab_size] of UTF-8 bytes each id stands for
    (0 for BOS/EOS/padding).
    """

    kind: str
    vocab_size: int
    bos: int
    eos: int
    _bytes_per_id: np.ndarray

    def encode(self, text: str | bytes) -> np.ndarray:
        """int32 ids [n] of `text` (bytes are decoded as UTF-8 where needed)."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of `ids`, without BOS/EOS."""
        raise NotImplementedError

    def encode_document(self, text: str | bytes) -> np.ndarray:
        """int32 ids [BOS, encode(text)..., EOS], shape [n + 2]."""
        return np.concatenate([[self.bos], self.encode(text), [self.eos]]).astype(np.int32)

    def utf8(self, ids: Iterable[int] | np.ndarray) -> bytes:
        """The UTF-8 bytes ``ids`` stand for, joined (BOS, EOS, padding: none); not
        always valid UTF-8 (:meth:`decode` makes U+FFFD of what is not)."""
        raise NotImplementedError

    def num_bytes(self, ids: Iterable[int] | np.ndarray) -> int:
        """UTF-8 bytes of text that `ids` cover (BOS, EOS, padding cover none)."""
        return int(self._bytes_per_id[np.asarray(ids, dtype=np.int64).reshape(-1)].sum())

    def sampleable(self, size: int) -> np.ndarray:
        """bool ``[size]``: the ids a model with ``size`` logits may generate: those
        that stand for text, and EOS; not BOS, padding or the model's ids past the
        vocabulary, which :meth:`decode` would drop."""
        allowed = np.zeros(size, bool)
        n = min(size, self.vocab_size)
        allowed[:n] = self._bytes_per_id[:n] > 0
        if self.eos < size:
            allowed[self.eos] = True
        return allowed

    def to_json(self) -> dict:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest that is equal for two tokenizers iff they tokenize alike."""
        raise NotImplementedError

    def describe(self, versus: Tokenizer | None = None) -> str:
        """``kind (N ids)``; beside a different tokenizer ``versus`` that reads the
        same, its fingerprint's first 8 digits too (learned from other text)."""
        plain = f"{self.kind} ({self.vocab_size} ids)"
        if versus is None or versus.describe() != plain:
            return plain
        return f"{self.kind} ({self.vocab_size} ids, {self.fingerprint[:8]})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, BOS 256, EOS 257 (the module-level functions)."""

    kind, vocab_size, bos, eos = "bytes", VOCAB_SIZE, BOS, EOS
    _bytes_per_id = np.array([1] * 256 + [0, 0], dtype=np.int64)

    def encode(self, text):
        return encode(text)

    def encode_document(self, text):
        return encode_document(text)

    def decode(self, ids):
        return decode(ids)

    def utf8(self, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()

    def to_json(self):
        return {"kind": "bytes"}

    @property
    def fingerprint(self):
        return hashlib.sha256(b"lexjax bytes tokenizer").hexdigest()


BYTES = ByteTokenizer()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (see the module docstring for its settings and ids)."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        import sentencepiece

        self.model_proto = bytes(model_proto)
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)
        sp = self._sp
        self.vocab_size, self.bos, self.eos = sp.get_piece_size(), sp.bos_id(), sp.eos_id()
        self._utf8 = [
            b""
            if sp.is_control(i) or sp.is_unknown(i)
            else bytes([int(sp.id_to_piece(i)[1:-1], 16)])  # "<0xE6>"
            if sp.is_byte(i)
            else sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8")
            for i in range(self.vocab_size)
        ]
        self._bytes_per_id = np.array([len(b) for b in self._utf8], dtype=np.int64)
        # A model learned from text with no space among its covered characters (Japanese
        # or Chinese text, or spaces rarer than the character coverage) has no "▁" piece:
        # SentencePiece then makes each space the byte fallback of "▁", 3 ids that decode
        # as "▁" and count 3 bytes. Such a model gets the space's own byte piece instead.
        self._space = sp.piece_to_id("<0x20>") if sp.is_unknown(sp.piece_to_id("\u2581")) else None

    # grain's worker processes get the tokenizer by pickling; the C++ processor
    # is rebuilt from the model bytes.
    def __getstate__(self):
        return {"model_proto": self.model_proto}

    def __setstate__(self, state):
        self.__init__(state["model_proto"])

    def encode(self, text):
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        if self._space is None or " " not in text:
            return np.asarray(self._sp.encode(text), dtype=np.int32)
        # No piece holds a space (it is no covered character), so the text's pieces are
        # those of its space-free parts; each space between them is its byte.
        ids = []
        for i, part in enumerate(self._sp.encode(text.split(" "))):
            if i:
                ids.append(self._space)
            ids.extend(part)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self._sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    def utf8(self, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return b"".join(self._utf8[i] for i in ids if 0 <= i < self.vocab_size)

    def to_json(self):
        return {
            "kind": "sentencepiece",
            "vocab_size": self.vocab_size,
            "sha256": self.fingerprint,
            "model": base64.b64encode(self.model_proto).decode("ascii"),
        }

    @property
    def fingerprint(self):
        return hashlib.sha256(self.model_proto).hexdigest()


def from_json(record: dict) -> Tokenizer:
    """The tokenizer of a ``to_json`` record (raises DataError on a damaged one: also
    one of another shape, or a model whose bytes do not match their checksum, which is
    checked before SentencePiece parses them)."""
    kind = record.get("kind") if isinstance(record, dict) else None
    if kind == "bytes":
        return BYTES
    if kind == "sentencepiece":
        try:
            proto = base64.b64decode(record["model"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the stored sentencepiece model is unreadable ({e!r})") from None
        if hashlib.sha256(proto).hexdigest() != record.get("sha256"):
            raise DataError("the stored sentencepiece model does not match its checksum")
        if not proto:  # (SentencePiece parses it as a model of 0 ids)
            raise DataError("the stored sentencepiece model is empty")
        try:
            return SentencePieceTokenizer(proto)
        except RuntimeError as e:  # SentencePiece's parser: its checksum matched, yet no model
            raise DataError(f"the stored sentencepiece model does not parse ({e})") from None
    if not isinstance(record, dict):
        raise DataError(f"the stored tokenizer record is a {type(record).__name__}, not a dict")
    raise DataError(f"unknown tokenizer kind {kind!r}; lexjax knows {', '.join(KINDS)}")


# Bytes of training text the SentencePiece trainer reads at most; a bounded,
# deterministic sample (see sample_lines) keeps time and memory bounded.
SAMPLE_BYTES = 16 << 20
_MAX_LINE_CHARS = 4096


def sample_lines(documents, budget: int = SAMPLE_BYTES) -> Iterator[str]:
    """Lines for the trainer: the leading lines of every document, an equal byte
    budget each, so one long file does not crowd out the rest; a line longer than
    the trainer takes goes in consecutive pieces of that length (a corpus of
    one-line files is sampled as much as any). Deterministic."""
    per_document = max(budget // max(len(documents), 1), 1)
    for index in range(len(documents)):
        document = documents[index]
        if isinstance(document, (bytes, bytearray)):
            document = bytes(document).decode("utf-8", errors="replace")
        taken = 0
        pieces = (  # an empty line is one empty piece: it counts its newline
            line[i : i + _MAX_LINE_CHARS]
            for line in document.split("\n")
            for i in range(0, max(len(line), 1), _MAX_LINE_CHARS)
        )
        for piece in pieces:
            if taken >= per_document:
                break
            taken += len(piece.encode("utf-8", "surrogatepass")) + 1  # bytes, as the budget
            if piece:
                yield piece


# SentencePiece learns in a child process. Its training is one call into C++ that
# holds the interpreter until it ends (many seconds on 16 MiB), and a signal
# handler only runs after it; the parent waits in Python instead, so SIGTERM and
# Ctrl-C stop a run that is still learning at once (the child is killed). The child
# imports sentencepiece only, from the parent's sys.path (a notebook's additions too);
# ``-P`` keeps the working directory off its path. It ignores SIGTERM, Ctrl-C and SIGHUP
# (sent to the whole process group by a terminal, a dropped ssh session or Slurm):
# whether they stop the learning is the parent's to decide. The model goes to a file,
# so nothing printed at its start (a sitecustomize) can mix into it.
_LEARNER = r"""
import ctypes, io, json, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
try:  # Linux: killed when the parent dies (PR_SET_PDEATHSIG), not left learning for none
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[3]):  # the parent died before that took hold
    sys.exit(1)
import sentencepiece
data = sys.stdin.buffer.read()
lines = (line.decode("utf-8", "surrogatepass") for line in data.split(b"\n")) if data else iter(())
model = io.BytesIO()
try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, **json.loads(sys.argv[1])
    )
except RuntimeError as e:
    sys.stderr.write(str(e))
    sys.exit(3)
with open(sys.argv[2], "wb") as f:
    f.write(model.getvalue())
"""


def train_sentencepiece(lines: Iterable[str], vocab_size: int) -> SentencePieceTokenizer:
    """Trains a unigram SentencePiece model of exactly `vocab_size` ids on `lines`
    (strings without newlines), in a child process that an exception raised while it
    learns (a signal handler's) kills.

    Raises DataError naming the largest (or smallest) vocabulary the text
    supports when `vocab_size` does not fit it.
    """
    options = dict(
        vocab_size=vocab_size,
        model_type="unigram",
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        character_coverage=0.9995,
        user_defined_symbols=["\n"],  # lines are sentences; newlines stay one id
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        max_sentence_length=4 * _MAX_LINE_CHARS,
        num_threads=2,
        minloglevel=2,
    )
    text = "\n".join(lines).encode("utf-8", "surrogatepass")
    if not text:  # SentencePiece's own words: "INTERNAL: … [!sentences_.empty()]"
        raise DataError(
            "sentencepiece has nothing to learn from: the train split holds no line with "
            "text; add text, or use data.tokenizer=bytes"
        )
    path = os.pathsep.join(p for p in sys.path if p)  # not "": the working directory
    env = dict(os.environ, PYTHONPATH=path)
    with tempfile.TemporaryDirectory(prefix="lexjax-sentencepiece-") as scratch:
        written = os.path.join(scratch, "model")
        try:
            learner = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-c",
                    _LEARNER,
                    json.dumps(options),
                    written,
                    str(os.getpid()),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
            )
        except OSError as e:  # an embedded interpreter: sys.executable is no program
            raise DataError(
                f"sentencepiece training needs a Python to run it in; sys.executable="
                f"{sys.executable!r} cannot be run ({e.strerror or e})"
            ) from None
        try:
            _, errors = learner.communicate(text)
        finally:
            if learner.returncode is None:  # stopped while it learned
                learner.kill()
                learner.wait()
        model = b""
        if learner.returncode == 0:
            with open(written, "rb") as f:
                model = f.read()
    message = errors.decode("utf-8", "replace").strip()
    if learner.returncode == 3:
        if largest := re.search(r"too high.*<= (\d+)", message):
            raise DataError(
                f"data.vocab_size={vocab_size} is more than this corpus supports; "
                f"use at most {largest[1]}"
            )
        if smallest := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
            raise DataError(
                f"data.vocab_size={vocab_size} cannot hold this corpus's characters; "
                f"use at least {smallest[1]}"
            )
        raise DataError(f"sentencepiece training failed: {(message.splitlines() or ['?'])[0]}")
    if learner.returncode != 0:  # a traceback (its last line says what), or a signal
        why = message.splitlines()[-1] if message else f"exit status {learner.returncode}"
        if learner.returncode < 0:
            why = f"the learning process was killed by {signal.Signals(-learner.returncode).name}"
        raise DataError(f"sentencepiece training failed: {why}")
    return SentencePieceTokenizer(model)

"""TFDS datasets written and read as ArrayRecord, with no TensorFlow anywhere.

Two builders turn text files into a TFDS dataset, each example
`{"text": str, "path": str}`:

- `python_stdlib`: every `.py` file of the running Python's standard library
  (`sysconfig.get_paths()['stdlib']`), without `site-packages`/`dist-packages`
  (third-party code) and without the stdlib's own `test`/`tests`/`idle_test`
  directories (generated fixtures and deliberately malformed files, not prose
  about the library). Present wherever Python is, so it is the default corpus.
- `textfiles`: the files matching a glob (`files='/data/**/*.txt'`), with
  optional `validation_files=` / `test_files=` globs for explicit held-out splits.

The split rule (no byte is ever in two splits):

1. Files matched by `validation_files` / `test_files` form those splits whole
   (and leave the `files` pool if it matches them too).
2. By file: a pool file goes to train/validation/test (90/5/5) by the SHA-256
   of its path relative to the corpus root, so the split never depends on
   which other files exist, on the machine, or on `PYTHONHASHSEED`; a file
   whose bucket is an explicit split goes to train. This rule is used when it
   gives train and every automatic held-out split at least one file.
3. Otherwise (one to a few dozen files) within files: every pool file keeps
   its head for train, and each automatic held-out split gets a 5% tail: with
   both automatic, bytes [0, 90%) train, [90%, 95%) validation, [95%, 100%)
   test. Each cut moves forward to the next line start (within 64 KiB, else the
   next UTF-8 character start).

A path reached through symlinks is the file it points to (its real path): one
file, in one split, counted once. A pool file with the same bytes as a file of
`validation_files` or `test_files` (a copy) is left out of training, and
counted among the skipped files.

Files are read in bounded pieces: a document is at most 4 MiB (a longer file or
piece becomes several documents, cut at line starts), so a file of hundreds of
MB is streamed. Empty files and binary files (a NUL byte in the first 8 KiB)
are skipped; invalid UTF-8 is decoded with U+FFFD replacement; the build line
counts both, and a corpus with no text left is a DataError.

One build per corpus: the dataset's config name is a fingerprint of the input
(the split rule, each file's role, relative path and contents), so
`<data_dir>/<name>/<fingerprint>/<version>/` holds one corpus; another corpus,
or a changed file, gets its own directory and two runs on different corpora
coexist. TFDS writes a build into a temporary directory and renames it on
success, so an interrupted build is never taken as complete. Tokenizers
learned from a build are stored in its directory (see `load_tokenizer`).

How the build avoids TensorFlow: `tfds.core.GeneratorBasedBuilder` with
`file_format='array_record'` and `download_and_prepare()` serializes examples
with TFDS's own protobuf serializer and writes through `array_record`; the
dataset info comes from `tfds.core.DatasetInfo(...)` directly (the
`dataset_info_from_configs` helper wants a package directory with metadata
files). Reading is the builder's `as_data_source`, or `tfds.data_source(name,
data_dir=..., download=False)` for other datasets.

Any other TFDS dataset (e.g. 'pg19') is read through `tfds.data_source`, once
it has been prepared as ArrayRecord in `data_dir` (e.g. `tfds build pg19
--file_format=array_record --data_dir=...`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fcntl
import functools
import glob
import hashlib
import logging
import os
import re
import shutil
import stat
import sysconfig
import time
from pathlib import PurePath

import numpy as np
import tensorflow_datasets as tfds

from lexjax.data import tokenizer as tokenizer_lib
from lexjax.errors import DataError, counted, globs_to_itself, one_line
from lexjax.lease import open_lock, try_flock

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "lexjax", "tensorflow_datasets")
SPLITS = ("train", "validation", "test")
BUILDER_NAMES = ("python_stdlib", "textfiles")

_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_GLOB_CHARS = frozenset("*?[")
_SPLIT_RULE = "lexjax split rule 2"  # part of the fingerprint: a new rule is a new build
# The build line's count of files left out as copies of held-out text (Plan.skipped).
_COPIES = "copies of held-out files"
_HELD_OUT_FRACTION = 0.05  # within files: each automatic held-out split's tail
_MAX_DOCUMENT_BYTES = 4 << 20
_SNAP_BYTES = 64 << 10  # how far a cut looks for a line start
_SNIFF_BYTES = 8 << 10  # a NUL byte in here marks a binary file


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
    """Returns the absolute data dir; None means DEFAULT_DATA_DIR."""
    return os.path.abspath(os.path.expanduser(os.fspath(data_dir or DEFAULT_DATA_DIR)))


def check_data_dir_path(data_dir: str | os.PathLike | None) -> None:
    """A :class:`DataError` for a data_dir whose path is a glob pattern that does not
    match itself (``data/[abc]``): TFDS finds a build's files with a glob of its
    directory's path, so the build was never found and the corpus was built anew at
    every use. For training (the evaluation of a run trained so still works, slowly)."""
    path = resolve_data_dir(data_dir)
    if not globs_to_itself(path):
        raise DataError(
            f"data.data_dir={path} holds a '[…]': TFDS reads its paths as glob patterns and "
            "would build the corpus anew at every use; choose a data_dir without '['"
        )


def path_text(relpath: str) -> str:
    """A file name as text: itself, where it is UTF-8 (nearly always); else its
    undecodable bytes (``os.fsdecode``'s surrogates) as ``\\xNN`` escapes, so a
    Latin-1 name in an old archive can be hashed, stored and printed."""
    return relpath.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def split_of(relpath: str) -> str:
    """Returns 'train' (90%), 'validation' (5%) or 'test' (5%) for a relative path."""
    digest = hashlib.sha256(path_text(relpath).encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    if bucket < 90:
        return "train"
    if bucket < 95:
        return "validation"
    return "test"


def stdlib_files(max_files: int | None = None) -> tuple[str, list[str]]:
    """Returns (stdlib root, sorted relative posix paths of its .py files).

    `max_files` keeps the first files in sorted order (for small test corpora).
    A link to nothing is left out, as a files= glob leaves it out (Debian's
    ``sitecustomize.py`` links to /etc, which a slimmed image may have removed).
    """
    root = sysconfig.get_paths()["stdlib"]
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if filename.endswith(".py") and os.path.isfile(path):
                relpaths.append(_relative(path, root))
    relpaths.sort()
    return root, relpaths[:max_files] if max_files is not None else relpaths


class NoFiles(DataError):
    """A glob of files (the setting ``what``) that matches none."""

    def __init__(self, what: str, pattern: str, hint: str):
        super().__init__(f"{what}={pattern!r} matches no files; {hint}")
        self.what, self.pattern = what, pattern


def glob_files(pattern: str, what: str = "data.files") -> tuple[str, list[str]]:
    """Returns (root, sorted relative posix paths) of the files matching a glob.

    The root is the pattern's leading directories that contain no wildcard, so
    '/data/books/**/*.txt' gives root '/data/books'. `**` matches recursively.
    `what` names the setting in the error for a glob that matches nothing.
    """
    pattern = os.path.abspath(os.path.expanduser(pattern))
    root = _glob_root(pattern)
    matches = _matching_files(pattern, what)
    if not matches:
        hint = f"pass a glob of existing text files, e.g. {what}='/data/books/**/*.txt'"
        if os.path.isdir(pattern):
            hint = (
                f"it is a directory: pass a glob of its files, e.g. {pattern}/** or {pattern}/*.txt"
            )
        elif escaped := _escaped_brackets(pattern):
            hint = (
                "a directory or file name in it holds '[', which glob reads as a set of "
                f"characters; escape it: {what}='{escaped}'"
            )
        elif re.search(r"\{[^{}]*,[^{}]*\}", pattern):  # a shell's {a,b}, quoted
            hint = (
                "a glob does not expand {a,b} as a shell does; pass one glob that matches "
                "every file, such as their common directory's /**/*.txt"
            )
        raise NoFiles(what, pattern, hint)
    return root, sorted(_relative(p, root) for p in matches)


# `**` follows symlinked directories: a loop of them repeats every path under it up
# to the system's limit of nested links (about 40), and two loops multiply the paths
# without end. Past this many paths, more than _MAX_PATHS_PER_ENTRY per distinct
# file or directory is such an explosion.
_LOOP_CHECK_AFTER = 100_000
_MAX_PATHS_PER_ENTRY = 64


def _matching_files(pattern: str, what: str) -> list[str]:
    """The files that ``pattern`` matches (every path of them); DataError once the
    matches show symlink loops that multiply the paths."""
    matches, seen, entries, real_dirs = [], 0, set(), {}
    for path in glob.iglob(pattern, recursive=True):
        try:
            st = os.stat(path)
        except OSError:  # a dangling link, a file gone meanwhile
            continue
        seen += 1
        # By the real directory and the name: a loop's paths repeat these, hard links
        # (other names, or other directories) do not.
        directory, name = os.path.split(path)
        if directory not in real_dirs:
            real_dirs[directory] = os.path.realpath(directory)
        entries.add((real_dirs[directory], name))
        if stat.S_ISREG(st.st_mode):
            matches.append(path)
        if seen > _LOOP_CHECK_AFTER and seen > _MAX_PATHS_PER_ENTRY * len(entries):
            raise DataError(
                f"{what}={pattern!r} reaches the same files over and over through symlink "
                f"loops ({seen} paths to {len(entries)} files and directories, and counting); "
                "remove the loops or narrow the glob"
            )
    return matches


def check_outside(pattern: str | None, what: str, places: dict[str, str]) -> None:
    """Raises DataError when the glob ``pattern`` (setting ``what``) matches files
    inside one of ``places`` (setting → directory: a run's workdir, the data dir):
    the run's own files would become corpus text, and another corpus every run.
    Globs only where such a directory lies under the glob's fixed root."""
    if not pattern:
        return
    pattern = os.path.abspath(os.path.expanduser(pattern))
    top, matched = os.path.realpath(_glob_root(pattern)), None
    for setting, place in places.items():
        place = os.path.realpath(os.path.expanduser(place))
        if not _within(place, top):
            continue  # the glob's root is not above the directory: nothing to match
        root, relpaths = matched = matched or glob_files(pattern, what)  # one glob at most
        inside = [r for r in relpaths if _within(os.path.join(root, r), place)]
        if inside:
            raise DataError(
                f"{what}={pattern!r} matches {len(inside)} file{'s' if len(inside) > 1 else ''} "
                f"inside {setting}={place} (first {inside[0]}), which would become corpus text "
                f"and change it every run; move {setting} out of the corpus or narrow the glob"
            )


def _within(path: str, directory: str) -> bool:
    path = os.path.realpath(path)
    return os.path.commonpath([path, directory]) == directory


def _escaped_brackets(pattern: str) -> str | None:
    """``pattern`` with its longest existing literal prefix that holds ``[`` escaped
    (``[2024] books`` is a directory, not a set of characters), if the escaped
    pattern matches files; else None."""
    for end in range(len(pattern), 0, -1):
        prefix = pattern[:end]
        whole = end == len(pattern) or pattern[end] == os.sep  # a whole name
        if "[" in prefix and whole and os.path.exists(prefix):
            escaped = glob.escape(prefix) + pattern[end:]
            if any(os.path.isfile(p) for p in glob.glob(escaped, recursive=True)):
                return escaped
            return None
    return None


def _glob_root(pattern: str) -> str:
    """An absolute glob's leading directories that hold no wildcard."""
    parts = PurePath(pattern).parts
    fixed = []
    for part in parts:
        if _GLOB_CHARS & set(part):
            break
        fixed.append(part)
    return os.path.join(*fixed) if len(fixed) < len(parts) else os.path.dirname(pattern)


def _relative(path: str, root: str) -> str:
    return PurePath(os.path.relpath(path, root)).as_posix()


# ---------------------------------------------------------------- the split plan


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of one file, all in one split."""

    root: str
    relpath: str
    start: int
    end: int

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.relpath)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which bytes of which files go to which split (see the module docstring).

    `rule` is 'by file' or 'within files'; `skipped` counts empty and binary
    files (and pool copies of held-out files); `fingerprint` is the SHA-256 hex
    digest that names the build.
    """

    pieces: dict[str, list[Piece]]
    rule: str
    num_files: int
    skipped: dict[str, int]
    fingerprint: str


def _file_digest(path: str) -> str:
    """SHA-256 of a file's contents, read in 1 MiB blocks; remembered for this
    process while the file keeps its size and modification time (a run opens
    its corpus several times: train, validation, tokenizer)."""
    stat = os.stat(path)
    return _content_digest(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1 << 16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # Only the cache key.
    digest = hashlib.sha256()
    with _reading(path), open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _reading(path: str):
    """A corpus file that cannot be read (its permissions, an I/O error) is one line
    naming it, not a traceback."""
    try:
        yield
    except OSError as e:
        raise DataError(
            f"cannot read {path} ({e.strerror or e}); make it readable or narrow the glob "
            "that selects it"
        ) from None


def _kind_of(path: str) -> str:
    """'empty', 'binary' (a NUL byte near the start) or 'text'."""
    with _reading(path), open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if not head:
        return "empty"
    return "binary" if b"\0" in head else "text"


def _keep_text(root: str, relpaths: list[str], skipped: dict[str, int]) -> list[str]:
    """The text files among `relpaths` (under `root`); the others are counted in
    `skipped` by kind."""
    kept = []
    for relpath in relpaths:
        kind = _kind_of(os.path.join(root, relpath))
        if kind == "text":
            kept.append(relpath)
        else:
            skipped[kind] += 1
    return kept


def _snap(f, size: int, offset: int) -> int:
    """The first line start at or after `offset` within _SNAP_BYTES, else the
    first UTF-8 character start at or after it, else `offset` itself (no character
    starts there: invalid UTF-8). f is open in binary mode."""
    if offset <= 0 or offset >= size:
        return min(max(offset, 0), size)
    f.seek(offset - 1)
    window = f.read(_SNAP_BYTES + 1)
    newline = window.find(b"\n")
    if newline != -1:
        return offset + newline  # just after the '\n' at window[newline]
    for i in range(1, len(window)):
        if window[i] & 0xC0 != 0x80:  # not a continuation byte
            return offset - 1 + i
    return offset


def _distinct(root: str, relpaths: list[str], taken: set) -> tuple[list[str], list[str]]:
    """(the `relpaths` (under `root`) that are distinct files not in `taken` (their
    identities: device and inode), whose identities are then added to it; those
    already in `taken`).

    A symlink to a file, a path through a symlinked directory (or a loop of them
    under `**`) and a hard link are the file they name, so its bytes are never in
    two splits or counted twice. Of several paths of one file, one without a
    symlink is kept, else the first in order."""
    real_root = os.path.realpath(root)
    paths = []
    for relpath in relpaths:
        real = os.path.realpath(os.path.join(root, relpath))
        try:
            info = os.stat(real)
            identity = (info.st_dev, info.st_ino)
        except OSError:  # (read as it is, where its reading says what is wrong)
            identity = real
        paths.append((real != os.path.join(real_root, relpath), relpath, identity))
    by_file: dict = {}
    for _, relpath, identity in sorted(paths):
        if identity not in taken:
            by_file.setdefault(identity, relpath)
    already = sorted(relpath for _, relpath, identity in paths if identity in taken)
    taken.update(by_file)
    return sorted(by_file.values()), already


def distinct_files(root: str, relpaths: list[str]) -> list[str]:
    """``relpaths`` (under ``root``, sorted) with each file once, as a build takes
    them: a path through a symlink, or a hard link, is the file it names."""
    return _distinct(root, relpaths, set())[0]


def plan_splits(
    pool: tuple[str, list[str]], explicit: dict[str, tuple[str, list[str]]] | None = None
) -> Plan:
    """The split plan of a pool of files and explicit held-out splits.

    `pool` and each `explicit[split]` are (root, relative paths), as from
    `glob_files`. Raises DataError when no text is left for some split.
    """
    explicit = dict(explicit or {})
    for split in explicit:
        if split not in ("validation", "test"):
            raise DataError(f"explicit files are for validation and test, not {split!r}")
    digest = hashlib.sha256(_SPLIT_RULE.encode())
    skipped = {"empty": 0, "binary": 0}
    taken = set()

    def text_files(role: str, root: str, relpaths: list[str]) -> list[str]:
        for relpath in relpaths:
            path = os.path.join(root, relpath)
            digest.update(f"{role}\0{path_text(relpath)}\0{_file_digest(path)}\n".encode())
        return _keep_text(root, relpaths, skipped)

    pieces: dict[str, list[Piece]] = {split: [] for split in SPLITS}
    for split, (root, relpaths) in sorted(explicit.items()):
        relpaths, both = _distinct(root, relpaths, taken)
        if both:  # the same file
            raise DataError(
                f"data.validation_files and data.test_files both select {len(both)} "
                f"file{'s' if len(both) > 1 else ''} (first {os.path.join(root, both[0])}), "
                "whose text would be in both splits; make the two globs select different files"
            )
        earlier = {_file_digest(p.path) for p in pieces["test"]}  # test's: it comes first
        copies = [r for r in relpaths if _file_digest(os.path.join(root, r)) in earlier]
        if copies:
            raise DataError(
                f"data.{split}_files selects {len(copies)} file{'s' if len(copies) > 1 else ''}"
                f" with the text of a data.test_files file (first {os.path.join(root, copies[0])}"
                ", a copy), which would be in both splits; select files of other text"
            )
        kept = text_files(split, root, relpaths)
        if not kept:  # (not "the corpus is too small": it names this setting as the cure)
            raise DataError(
                f"data.{split}_files selects no text: its {len(relpaths)} "
                f"file{'s are' if len(relpaths) > 1 else ' is'} empty or binary; make it "
                "select text files"
            )
        for relpath in kept:
            pieces[split].append(
                Piece(root, relpath, 0, os.path.getsize(os.path.join(root, relpath)))
            )
    root, relpaths = pool
    left = _distinct(root, relpaths, taken)[0]
    if explicit:  # a pool file with a held-out file's bytes (a copy, not a link) is that text
        held = {_file_digest(p.path) for split in explicit for p in pieces[split]}
        copies = [r for r in left if _file_digest(os.path.join(root, r)) in held]
        if copies:
            left = [r for r in left if r not in copies]
            skipped[_COPIES] = len(copies)
    if relpaths and not left:
        flags = " and ".join(f"data.{split}_files" for split in sorted(explicit, reverse=True))
        one = len(explicit) == 1
        raise DataError(
            f"no training text: {flags} {'selects' if one else 'select'} every file data.files "
            f"does ({len(relpaths)}); make {'it' if one else 'them'} select fewer"
        )
    pool_files = text_files("pool", root, left)
    num_files = len(pool_files) + sum(len(p) for p in pieces.values())
    if not pool_files:
        raise DataError(_no_text("training", skipped))
    held = [s for s in ("validation", "test") if s not in explicit]
    by_file = {r: split_of(r) for r in pool_files}
    by_file = {r: (s if s in held else "train") for r, s in by_file.items()}
    # Train keeps a file too: one book whose bucket is test, with validation_files, went
    # wholly to test and left no training text ("too small to hold out train text").
    # Copies whose paths hash to two splits keep their text in one (test before
    # validation before train); the other copies are left out and counted. The rule
    # is by file only where every split keeps a file then.
    homes: dict[str, str] = {}
    split_copies = set()
    for relpath in sorted(pool_files, key=lambda r: -SPLITS.index(by_file[r])):
        home = homes.setdefault(_file_digest(os.path.join(root, relpath)), by_file[relpath])
        if home != by_file[relpath]:
            split_copies.add(relpath)
    kept = {by_file[r] for r in pool_files if r not in split_copies}
    if all(s in kept for s in (*held, "train")):
        rule = "by file"
        for relpath in pool_files:
            if relpath in split_copies:
                digest.update(f"copy left out\0{path_text(relpath)}\n".encode())
                skipped[_COPIES] = skipped.get(_COPIES, 0) + 1
                continue
            size = os.path.getsize(os.path.join(root, relpath))
            pieces[by_file[relpath]].append(Piece(root, relpath, 0, size))
    else:
        rule = "within files"
        fractions = [1 - _HELD_OUT_FRACTION * k for k in range(len(held), 0, -1)]
        for relpath in pool_files:
            path = os.path.join(root, relpath)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                cuts = [0] + [_snap(f, size, int(size * x)) for x in fractions] + [size]
            cuts = [max(cuts[: i + 1]) for i in range(len(cuts))]  # never a byte twice
            for split, start, end in zip(["train"] + held, cuts, cuts[1:]):
                if end > start:
                    pieces[split].append(Piece(root, relpath, start, end))
    if not pieces["train"]:
        raise DataError(
            f"the corpus is too small to train on once validation and test text are held out "
            f"({num_files} text files); add text to data.files"
        )
    if missing := [split for split in SPLITS if not pieces[split]]:  # all named at once
        raise DataError(
            f"the corpus is too small to hold out {' and '.join(missing)} text ({num_files} "
            f"text files); add text or pass {' and '.join(f'data.{s}_files' for s in missing)}"
        )
    digest.update(rule.encode())
    return Plan(pieces, rule, num_files, skipped, digest.hexdigest())


def decode_text(raw: bytes) -> tuple[str, bool]:
    """``(text, replaced)``: ``raw`` as UTF-8, invalid bytes replaced by U+FFFD
    (``replaced``), as a build (and evaluation on other files) reads every file."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def text_files_of(root: str, relpaths: list[str], what: str, say) -> list[str]:
    """The text files among `relpaths` (under `root`): empty and binary ones are
    skipped with one note through `say`; DataError when none is left."""
    skipped = {"empty": 0, "binary": 0}
    kept = _keep_text(root, relpaths, skipped)
    if not kept:
        raise DataError(_no_text(what, skipped))
    if len(kept) < len(relpaths):
        say(f"note: {what} files: skipped {_counts(skipped)} of {len(relpaths)}")
    return kept


def _counts(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in skipped.items() if n)


def _no_text(what: str, skipped: dict[str, int]) -> str:
    return (
        f"no {what} text: the files are {skipped['empty']} empty and "
        f"{skipped['binary']} binary (a NUL byte in the first 8 KiB), all skipped; "
        "pass a glob of text files (text in UTF-16 or UTF-32 mostly reads as binary: "
        "convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8)"
    )


def documents(piece: Piece, *, to_end_of_file: bool = False):
    """Yields (start offset, bytes) of the documents of a piece: at most
    _MAX_DOCUMENT_BYTES each, cut at line starts where possible, read streaming.
    With ``to_end_of_file``, the piece's end is not known (a file whose size
    says nothing of its contents, as in /proc and /sys): it ends where reads do."""
    with open(piece.path, "rb") as f:
        start = piece.start
        while to_end_of_file or start < piece.end:
            f.seek(start)
            want = (
                _MAX_DOCUMENT_BYTES
                if to_end_of_file
                else min(_MAX_DOCUMENT_BYTES, piece.end - start)
            )
            chunk = f.read(want)
            if not chunk and to_end_of_file:
                return
            if not chunk:  # the file shrank since its size was taken
                raise DataError(
                    f"{piece.path} changed while it was read (it ends at byte {start}, "
                    f"not {piece.end}); read it again when nothing writes to it"
                )
            if len(chunk) == want and (to_end_of_file or start + want < piece.end):
                newline = chunk.rfind(b"\n")
                if newline != -1:
                    chunk = chunk[: newline + 1]
                else:  # no line break in 4 MiB: cut before a character start
                    # (UTF-8 has at most 3 continuation bytes; in other bytes, such as
                    # a lead byte followed only by continuation bytes, the window is
                    # cut where it ends instead of nowhere, which never advanced).
                    cut = len(chunk)
                    while cut > len(chunk) - 3 and chunk[cut - 1] & 0xC0 == 0x80:
                        cut -= 1
                    if chunk[cut - 1] >= 0xC0:  # the lead byte of the character cut off
                        cut -= 1
                    chunk = chunk[:cut] if cut > 0 else chunk
            yield start, chunk
            start += len(chunk)


def file_document(path: str, tokenizer, max_tokens: int | None = None):
    """``(ids, replaced)``: the file at ``path`` as one document of ``tokenizer``'s
    int32 ids ``[BOS, ..., EOS]``, read and tokenized in the pieces of at most
    4 MiB that a build reads (cut at line starts), the ids of each piece joined.
    ``replaced``: invalid UTF-8 was read as U+FFFD. With ``max_tokens``, reading
    stops at the piece that reaches that many ids and the document is its first
    ``max_tokens`` ids (no EOS where the file was cut): a file of hundreds of MB
    costs one piece when a few thousand tokens of it are scored."""
    ids, held, replaced = [np.array([tokenizer.bos], np.int32)], 1, False
    whole = Piece(os.path.dirname(path), os.path.basename(path), 0, -1)
    for _, raw in documents(whole, to_end_of_file=True):
        text, invalid = decode_text(raw)
        replaced |= invalid
        ids.append(np.asarray(tokenizer.encode(text), np.int32))
        held += len(ids[-1])
        if max_tokens is not None and held >= max_tokens:
            break
    else:
        ids.append(np.array([tokenizer.eos], np.int32))
    document = np.concatenate(ids)
    return (document if max_tokens is None else document[:max_tokens]), replaced


# ---------------------------------------------------------------- TFDS builders


class _LocalInfo(tfds.core.DatasetInfo):
    """DatasetInfo of a corpus made here: there is nothing to fetch from TFDS's bucket.

    (TFDS's own fetch leaves an empty `tmpXXXXtfds` directory in $TMPDIR for
    every builder constructed before its data exists.)
    """

    def initialize_from_bucket(self) -> None:
        pass


class _FileCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Documents of the pieces of a Plan: {'text': str, 'path': path relative to the root}."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {
        "1.0.0": "One document per file; 90/5/5 split by SHA-256 of the relative path.",
        "2.0.0": "One build per input fingerprint; within-file split for few files; "
        "documents of at most 4 MiB; explicit validation/test files.",
    }

    def __init__(self, *, plan: Plan, file_format: str = "array_record", **kwargs):
        self.plan = plan
        self.replaced = set()  # files decoded with U+FFFD replacement in this build
        config = tfds.core.BuilderConfig(name=plan.fingerprint[:16])
        super().__init__(config=config, file_format=file_format, **kwargs)

    # A data source of this builder reaches grain's worker processes pickled, and
    # TFDS pickles a builder as its base arguments (data_dir, config, version),
    # which cannot make this one: it is made from its plan.
    def __getstate__(self):
        return {"plan": self.plan, "data_dir": self._original_state["data_dir"]}

    def __setstate__(self, state):
        with _quiet_tfds():  # "Using custom data configuration", in every worker
            self.__init__(**state)

    # TFDS looks beside a builder's source file for checksums and metadata
    # files; these builders download nothing and have none. Saying so also
    # skips tfds 4.9.10's import of the undeclared `importlib_resources`
    # package on that path (tensorflow/datasets#11212).
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return None

    # TFDS announces a download ("Downloading and preparing dataset Unknown
    # size ...") and its end; nothing is downloaded here and prepare() says
    # what it builds in one line.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing is downloaded.
        plan = self.plan
        self.info.metadata.update(
            source_fingerprint=plan.fingerprint,
            split_rule=plan.rule,
            num_files=plan.num_files,
            skipped=plan.skipped,
        )
        return {split: self._generate_examples(plan.pieces[split]) for split in SPLITS}

    def _generate_examples(self, pieces):
        keys = set()
        for piece in pieces:
            for start, chunk in documents(piece):
                text, replaced = decode_text(chunk)
                if replaced:
                    self.replaced.add(piece.path)
                # The key of a whole small file is its path, as in version 1.0.0, so
                # TFDS's key-hash order of the documents (hence evaluation's) stays.
                name = path_text(piece.relpath)
                key = name if start == 0 else f"{name}@{start}"
                while key in keys:  # names that read alike: 'caf\xe9' in Latin-1 and ASCII
                    key += "+"
                keys.add(key)
                yield key, {"text": text, "path": name}


class PythonStdlib(_FileCorpus):
    """The .py files of the running Python's standard library (no tests, no site-packages)."""

    name = "python_stdlib"


class TextFiles(_FileCorpus):
    """The files matching a glob, given as `files=`."""

    name = "textfiles"


_BUILDERS = {"python_stdlib": PythonStdlib, "textfiles": TextFiles}


def plan_corpus(
    name: str,
    files: str | None = None,
    *,
    validation_files: str | None = None,
    test_files: str | None = None,
    max_files: int | None = None,
) -> Plan:
    """The split plan of `python_stdlib` or `textfiles` (see `prepare`)."""
    explicit = {}
    if validation_files:
        explicit["validation"] = glob_files(validation_files, "data.validation_files")
    if test_files:
        explicit["test"] = glob_files(test_files, "data.test_files")
    if name == "python_stdlib":
        if files is not None:
            raise DataError(
                "data.files is read by data.name=textfiles only; set data.name=textfiles to "
                "train on those files, or leave data.files out for python_stdlib"
            )
        return plan_splits(stdlib_files(max_files), explicit)
    if name == "textfiles":
        if max_files is not None:
            raise DataError(
                "max_files= applies to 'python_stdlib' only; narrow the files= glob instead"
            )
        if not files:
            raise DataError("textfiles needs files='<glob>', e.g. files='/data/**/*.txt'")
        return plan_splits(glob_files(files), explicit)
    raise DataError(
        f"prepare() builds {BUILDER_NAMES}, not {name!r}; prepare other datasets with `tfds build`"
    )


def build_name(
    name: str,
    files: str | None = None,
    *,
    validation_files: str | None = None,
    test_files: str | None = None,
    max_files: int | None = None,
) -> str | None:
    """The ``name/config/version`` (:attr:`TextSource.build`) of the build these
    files make, found without building (the files are read to fingerprint
    them); None for a dataset lexjax does not build."""
    if name not in BUILDER_NAMES:
        return None
    plan = plan_corpus(
        name, files, validation_files=validation_files, test_files=test_files, max_files=max_files
    )
    return f"{name}/{plan.fingerprint[:16]}/{_BUILDERS[name].VERSION}"


def planned_build(data) -> str | None:
    """:func:`build_name` of the corpus a data config (``lexjax.config.DataConfig``:
    its name and file globs) makes."""
    return build_name(
        data.name, data.files, validation_files=data.validation_files, test_files=data.test_files
    )


def prepare(
    name: str,
    data_dir: str | os.PathLike | None = None,
    files: str | None = None,
    *,
    validation_files: str | None = None,
    test_files: str | None = None,
    max_files: int | None = None,
) -> tfds.core.DatasetBuilder:
    """Builds `python_stdlib` or `textfiles` into data_dir once per corpus; later
    calls with the same input files reuse that build.

    The build lives in `<data_dir>/<name>/<fingerprint>/2.0.0/`; changing,
    adding or removing a file makes a new one beside it. Prints one line while
    building: the file count, the split rule and what was skipped or replaced.
    Processes preparing one corpus at once build it once (a file lock beside the
    build, `.<fingerprint>.lock`); the others wait and read that build.
    """
    data_dir = resolve_data_dir(data_dir)
    plan = plan_corpus(
        name, files, validation_files=validation_files, test_files=test_files, max_files=max_files
    )

    def builder_of_plan():
        with _quiet_tfds():  # is_prepared() warns about a version folder not written yet
            try:
                builder = _BUILDERS[name](plan=plan, data_dir=data_dir)
            except Exception as e:  # TFDS reads a build's dataset_info.json and features here
                build_dir = os.path.join(data_dir, name, plan.fingerprint[:16], "2.0.0")
                if not os.path.exists(os.path.join(build_dir, "dataset_info.json")):
                    raise
                raise _damaged(build_dir, name, e) from e
            prepared = builder.is_prepared()
            # TFDS renames a build into place once its dataset_info.json is written, and
            # takes a directory there as built: one without it (removed, or a copy of
            # data_dir that stopped midway) was "built" again in no time, then no split
            # could be read ("`splits` is empty"; eval.py fell back to validation).
            build_dir = os.fspath(builder.data_path)
            info = os.path.join(build_dir, "dataset_info.json")
            if not prepared and os.path.isdir(build_dir) and not os.path.exists(info):
                raise _damaged(build_dir, name, ValueError("it has no dataset_info.json"))
            return builder, prepared

    builder, prepared = builder_of_plan()
    if prepared:  # (the rebuild after a kill, within the hour, left the dead one's copy)
        _remove_unfinished_builds(builder.data_dir)
        return builder
    # Processes that start together on one host (the local processes of a
    # multi-process run, two runs launched at once) build a corpus once: the
    # first to take the lock builds, the others wait and then read its build.
    try:
        os.makedirs(os.path.join(data_dir, name), exist_ok=True)
    except OSError as e:
        raise _unwritable(data_dir, e, e.filename) from e
    lock = os.path.join(data_dir, name, f".{plan.fingerprint[:16]}.lock")
    waiting = f"waiting for another process's build of dataset {name} in {data_dir}"
    with _one_at_a_time(lock, waiting, data_dir):
        builder, prepared = builder_of_plan()
        if not prepared:
            _remove_unfinished_builds(builder.data_dir)
            skipped = _counts(plan.skipped)
            try:  # the line is ended whatever stops the build (a signal: also in print)
                print(
                    f"building dataset {name} ({counted(plan.num_files, 'file')}, split {plan.rule}"
                    f"{'; skipped ' + skipped if skipped else ''}) in {data_dir}...",
                    end="",
                    flush=True,
                )
                with _quiet_tfds():
                    builder.download_and_prepare()
            except BaseException as e:  # a signal handler's too (SIGTERM while building)
                print(flush=True)  # ends the "building dataset ..." line
                if not isinstance(e, Exception) or (reason := _os_reason(e)) is None:
                    raise
                cure = {
                    "No space left on device": "free space there",
                    "Disk quota exceeded": "free space there",
                    "File too large": "raise the file-size limit (ulimit -f)",
                    "Read-only file system": "make data_dir writable",
                }.get(reason, "fix that")
                raise DataError(
                    f"data.data_dir={data_dir}: building the corpus {name} failed ({reason}); "
                    f"{cure} or choose another data.data_dir"
                ) from None
            n = len(builder.replaced)
            replaced = f"; {counted(n, 'file')} had invalid UTF-8, replaced by U+FFFD"
            print(f" done{replaced if builder.replaced else ''}", flush=True)
    return builder


def _did_you_mean(name: str, names) -> str:
    """`` (did you mean data.name=X?)`` for the closest of ``names``, or nothing."""
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean data.name={close[0]}?)" if close else ""


@contextlib.contextmanager
def _one_at_a_time(lock_path: str, waiting: str, data_dir: str, writes: str | None = None):
    """Holds an exclusive lock on ``lock_path`` (flock: released when the file closes,
    whatever ends the process); says ``waiting`` first where another process holds it
    (a long build elsewhere would be a silent wait here). A lock that cannot be made
    (a read-only data_dir) is the error of writing ``writes`` (default: the lock)."""
    try:
        lock = open_lock(lock_path)
    except OSError as e:
        raise _unwritable(data_dir, e, writes or e.filename) from e
    with lock:
        if try_flock(lock) is False:  # None: no flock here, unlocked as before
            print(waiting, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# An unfinished build untouched this long is dead: a live one writes its shards all along.
_DEAD_BUILD_S = 3600


def _remove_unfinished_builds(version_dir: str) -> None:
    """Deletes what builds of ``version_dir`` killed midway (SIGKILL, a power cut) left
    beside it: TFDS writes into ``incomplete.<random>_<version>`` and renames it when
    done, so each dead build kept a partial copy of the corpus for good. Only one
    nothing in has changed for :data:`_DEAD_BUILD_S`: where flock is per host (some
    cluster filesystems) or missing, another build may be writing one now. Called by
    every use of the corpus, so a copy younger than that at the rebuild goes later."""
    parent, version = os.path.split(os.path.normpath(version_dir))
    for path in glob.glob(os.path.join(glob.escape(parent), f"incomplete.*_{version}")):
        try:
            newest = max(
                os.lstat(os.path.join(top, name)).st_mtime
                for top, dirs, files in os.walk(path)
                for name in [".", *files]
            )
        except (OSError, ValueError):  # gone meanwhile, or unreadable: not ours to judge
            continue
        if time.time() - newest > _DEAD_BUILD_S:
            shutil.rmtree(path, ignore_errors=True)


class MissingSplit(DataError):
    """The dataset has no such split (or TFDS cannot parse the split's name)."""


def _damaged(build_dir: str, name: str, error: Exception) -> DataError:
    again = (
        "run again to build it from the files again"
        if name in BUILDER_NAMES
        else f"prepare it again with `tfds build {name} --file_format=array_record`"
    )
    return DataError(
        f"the corpus build {build_dir} is damaged; delete it and {again} "
        f"({one_line(error, limit=120)})"
    )


# What TFDS's writers say (inside their own exceptions) when the disk refuses a write.
_OS_REASONS = (
    "No space left on device",
    "Disk quota exceeded",
    "Read-only file system",
    "File too large",  # EFBIG: a file-size limit (ulimit -f, RLIMIT_FSIZE)
)


def _os_reason(error: BaseException) -> str | None:
    """The operating system's reason a build failed (an OSError's, or one of
    :data:`_OS_REASONS` in a message down the chain), else None (not the disk's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
        if reason := next((r for r in _OS_REASONS if r in str(error)), None):
            return reason
        error = error.__cause__ or error.__context__
    return None


def _unwritable(data_dir: str, error: OSError, path: str) -> DataError:
    return DataError(
        f"data.data_dir={data_dir}: cannot create {path} ({error.strerror}); choose another "
        "data.data_dir, or make this one a writable directory (a symlink to one will do)"
    )


@contextlib.contextmanager
def _quiet_tfds():
    """Silences TFDS while it looks for and writes a dataset: its tqdm bars
    (escape codes in logs) and its absl warnings about the version folder it has
    not written yet ("Variant folder ... has no dataset_info.json")."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(True)
        absl_logger.setLevel(level)


class TextSource:
    """Random access to the documents of one split: `source[i]` is raw text as bytes.

    Documents stay raw text so that tokenization happens in the pipeline
    (`lexjax.data.pipeline`); `len(source)` is the number of documents.
    """

    def __init__(self, records, text_feature: str = "text"):
        self._records = records
        self._text_feature = text_feature

    def __len__(self) -> int:
        return len(self._records)

    @property
    def build(self) -> str | None:
        """The dataset's ``name/config/version``; a built corpus's config is its
        fingerprint, so another corpus (even of as many documents) has another."""
        info = getattr(self._records, "dataset_info", None)
        return getattr(info, "full_name", None)

    def __getitem__(self, index: int) -> bytes:
        try:
            text = self._records[index][self._text_feature]
        except RuntimeError as e:  # array_record: a truncated or corrupted file
            raise self._damaged(e) from e
        if text is None:  # a file cut short past its first records: they read as empty
            raise self._damaged(ValueError(f"record {index} has no {self._text_feature!r}"))
        return text.encode("utf-8") if isinstance(text, str) else bytes(text)

    def _damaged(self, error: Exception) -> DataError:
        info = self._records.dataset_info
        return _damaged(os.fspath(info.data_dir), info.name, error)

    def __repr__(self) -> str:
        return f"TextSource({self._records!r}, text_feature={self._text_feature!r})"


def _open(
    name: str,
    data_dir: str | os.PathLike | None,
    files: str | None,
    validation_files: str | None,
    test_files: str | None,
    max_files: int | None,
):
    """(records of a split → ArrayRecord data source, directory of the build)."""
    data_dir = resolve_data_dir(data_dir)
    if name in BUILDER_NAMES:
        builder = prepare(
            name,
            data_dir,
            files,
            validation_files=validation_files,
            test_files=test_files,
            max_files=max_files,
        )
        return builder.as_data_source, os.fspath(builder.data_path)
    if any(x is not None for x in (files, validation_files, test_files, max_files)):
        raise DataError(
            f"files=/validation_files=/test_files=/max_files= apply to {BUILDER_NAMES} "
            f"only, not {name!r}{_did_you_mean(name, BUILDER_NAMES)}"
        )
    base = name.split(":")[0]
    infos = glob.glob(os.path.join(data_dir, base, "**", "dataset_info.json"), recursive=True)
    if not infos:
        known = tfds.list_builders(with_community_datasets=False)
        raise DataError(
            f"dataset {name!r} is not prepared in {data_dir}"
            f"{'' if base in known else _did_you_mean(base, [*BUILDER_NAMES, *known])}; run "
            f"`tfds build {base} --file_format=array_record --data_dir={data_dir}` or use "
            f"one of {BUILDER_NAMES}"
        )

    def records(split):
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)

    # The build TFDS reads (a name without a version: its newest; without a config: its
    # default), where its tokenizer is stored: the last dataset_info.json in path order
    # was another version's or config's (10.0.0 sorts before 2.0.0), whose tokenizer,
    # learned from other text, another run of the same vocab_size then took as its own.
    try:
        with _quiet_tfds():
            build_dir = os.fspath(tfds.builder(name, data_dir=data_dir).data_dir)
    except (ValueError, KeyError, NotImplementedError, FileNotFoundError):
        build_dir = os.path.dirname(sorted(infos)[-1])  # (reading a split says what is wrong)
    return records, build_dir


def load_source(
    name: str,
    split: str,
    data_dir: str | os.PathLike | None = None,
    files: str | None = None,
    *,
    validation_files: str | None = None,
    test_files: str | None = None,
    text_feature: str = "text",
    max_files: int | None = None,
) -> TextSource:
    """Returns a random-access TextSource over one split of a TFDS dataset.

    `python_stdlib` and `textfiles` are built on first use (see `prepare`);
    any other name must already be prepared as ArrayRecord in data_dir.
    `split` accepts the TFDS split syntax ('train', 'validation[:10%]', ...).
    """
    records_of, build_dir = _open(name, data_dir, files, validation_files, test_files, max_files)
    try:
        records = records_of(split)
    except (ValueError, KeyError, NotImplementedError, FileNotFoundError) as e:
        raise MissingSplit(
            f"cannot read split {split!r} of {name!r} from {resolve_data_dir(data_dir)}: "
            f"{one_line(e)}"
        ) from e
    except RuntimeError as e:  # array_record cannot open a file of the build
        raise _damaged(build_dir, name, e) from e
    features = records.dataset_info.features
    if text_feature not in features:
        texts = [k for k, f in sorted(features.items()) if isinstance(f, tfds.features.Text)]
        texts = ["text"] if name in BUILDER_NAMES else texts  # not the file's "path"
        raise DataError(
            f"{name!r} has no feature {text_feature!r}; set data.text_feature to one of {texts}"
        )
    source = TextSource(records, text_feature)
    for index in sorted({0, len(source) - 1} - {-1}):
        source[index]  # a damaged (e.g. truncated) file fails here, not in training's pipeline
    return source


def load_tokenizer(
    kind: str,
    vocab_size: int,
    name: str,
    data_dir: str | os.PathLike | None = None,
    files: str | None = None,
    *,
    validation_files: str | None = None,
    test_files: str | None = None,
    text_feature: str = "text",
    max_files: int | None = None,
    train: bool = True,
) -> tokenizer_lib.Tokenizer | None:
    """The tokenizer of a corpus: bytes, or the SentencePiece model of `vocab_size`
    ids learned from its train split (None when it has none yet and not `train`).

    A SentencePiece model is trained once per build (on a bounded sample,
    `tokenizer.SAMPLE_BYTES`, with one progress line) and stored in the build's
    directory as `sentencepiece-<vocab_size>.model` (`…-<text_feature>.model` for a
    feature other than `text`), written to a temporary
    name and renamed, so a failed training leaves nothing that looks complete.
    """
    if kind == "bytes":
        return tokenizer_lib.BYTES
    if kind != "sentencepiece":
        raise DataError(f"unknown tokenizer {kind!r}; use one of {', '.join(tokenizer_lib.KINDS)}")
    _, build_dir = _open(name, data_dir, files, validation_files, test_files, max_files)
    # Learned from one feature's text: another feature's model has its own name.
    feature = "" if text_feature == "text" else f"-{text_feature}"
    path = os.path.join(build_dir, f"sentencepiece-{vocab_size}{feature}.model")
    if os.path.exists(path):
        return _stored_tokenizer(path)
    if not train:
        return None
    # Runs sharing a data_dir learn it once: the others wait, then read it.
    waiting = f"waiting for another process's sentencepiece tokenizer {path}"
    lock = os.path.join(build_dir, f".{os.path.basename(path)}.lock")  # hidden, as the build's
    with _one_at_a_time(lock, waiting, resolve_data_dir(data_dir), writes=path):
        if os.path.exists(path):
            return _stored_tokenizer(path)
        return _learn_tokenizer(
            path,
            vocab_size,
            name,
            data_dir,
            files,
            validation_files=validation_files,
            test_files=test_files,
            text_feature=text_feature,
            max_files=max_files,
        )


def _stored_tokenizer(path: str) -> tokenizer_lib.Tokenizer:
    with open(path, "rb") as f:
        model = f.read()
    try:
        return tokenizer_lib.SentencePieceTokenizer(model)
    except RuntimeError as e:  # sentencepiece cannot parse it
        raise DataError(
            f"the SentencePiece model {path} is damaged; delete it and run again to "
            f"learn it again ({one_line(e, limit=120)})"
        ) from e


def _learn_tokenizer(path, vocab_size, name, data_dir, files, **corpus) -> tokenizer_lib.Tokenizer:
    """Learns the SentencePiece model of :func:`load_tokenizer` and stores it at ``path``."""
    train = load_source(name, "train", data_dir, files, **corpus)
    budget = tokenizer_lib.SAMPLE_BYTES
    print(
        f"training sentencepiece tokenizer ({vocab_size} ids) on up to "
        f"{budget >> 20} MiB of {len(train)} training documents...",
        end="",
        flush=True,
    )
    start = time.perf_counter()
    try:
        trained = tokenizer_lib.train_sentencepiece(
            tokenizer_lib.sample_lines(train, budget), vocab_size
        )
    finally:
        print(f" {time.perf_counter() - start:.0f} s", flush=True)
    partial = f"{path}.tmp{os.getpid()}"
    try:
        with open(partial, "wb") as f:
            f.write(trained.model_proto)
        os.replace(partial, path)
    except OSError as e:  # a shared read-only data_dir, a full disk
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise _unwritable(resolve_data_dir(data_dir), e, path) from e
    return trained

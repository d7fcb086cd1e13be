"""TFDS datasets written and read as ArrayRecord, with no TensorFlow anywhere.

Two builders turn a directory of text files into a TFDS dataset, one document
per file, each example `{"text": bytes, "path": str}`:

- `python_stdlib`: every `.py` file of the running Python's standard library
  (`sysconfig.get_paths()['stdlib']`), without `site-packages`/`dist-packages`
  (third-party code) and without the stdlib's own `test`/`tests`/`idle_test`
  directories (generated fixtures and deliberately malformed files, not prose
  about the library). Present wherever Python is, so it is the default corpus.
- `textfiles`: the files matching a glob (`files='/data/**/*.txt'`).

A file goes to train/validation/test (90/5/5) by the SHA-256 of its path
relative to the corpus root, so the split never depends on which other files
exist, on the machine, or on `PYTHONHASHSEED`. A split that receives no file is
not written (TFDS refuses empty splits); asking for it raises DataError.

How the build avoids TensorFlow: `tfds.core.GeneratorBasedBuilder` with
`file_format='array_record'` and `download_and_prepare()` serializes examples
with TFDS's own protobuf serializer and writes through `array_record`; the
dataset info comes from `tfds.core.DatasetInfo(...)` directly (the
`dataset_info_from_configs` helper wants a package directory with metadata
files). Reading is `tfds.data_source(name, data_dir=..., download=False)`.

The dataset version is the builder's `VERSION` (the directory
`<data_dir>/<name>/<version>/`). A fingerprint of the input files (SHA-256 over
relative paths and contents) is stored in the dataset's `metadata.json`,
written atomically with the data; loading compares it against the files on
disk and refuses a mismatch with a message saying how to rebuild.

Any other TFDS dataset (e.g. 'pg19') is read through the same
`tfds.data_source` call, once it has been prepared as ArrayRecord in
`data_dir` (e.g. `tfds build pg19 --file_format=array_record --data_dir=...`).
"""

import contextlib
import functools
import glob
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from pathlib import Path, PurePath

import tensorflow_datasets as tfds

from lexjax.errors import DataError

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "lexjax", "tensorflow_datasets")
SPLITS = ("train", "validation", "test")
BUILDER_NAMES = ("python_stdlib", "textfiles")

_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_GLOB_CHARS = frozenset("*?[")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
    """Returns the absolute data dir; None means DEFAULT_DATA_DIR."""
    return os.path.abspath(os.path.expanduser(os.fspath(data_dir or DEFAULT_DATA_DIR)))


def split_of(relpath: str) -> str:
    """Returns 'train' (90%), 'validation' (5%) or 'test' (5%) for a relative path."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    if bucket < 90:
        return "train"
    if bucket < 95:
        return "validation"
    return "test"


def stdlib_files(max_files: int | None = None) -> tuple[str, list[str]]:
    """Returns (stdlib root, sorted relative posix paths of its .py files).

    `max_files` keeps the first files in sorted order (for small test corpora).
    """
    root = sysconfig.get_paths()["stdlib"]
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                relpaths.append(_relative(os.path.join(dirpath, filename), root))
    relpaths.sort()
    return root, relpaths[:max_files] if max_files is not None else relpaths


def glob_files(pattern: str) -> tuple[str, list[str]]:
    """Returns (root, sorted relative posix paths) of the files matching a glob.

    The root is the pattern's leading directories that contain no wildcard, so
    '/data/books/**/*.txt' gives root '/data/books'. `**` matches recursively.
    """
    pattern = os.path.abspath(os.path.expanduser(pattern))
    parts = PurePath(pattern).parts
    fixed = []
    for part in parts:
        if _GLOB_CHARS & set(part):
            break
        fixed.append(part)
    root = os.path.join(*fixed) if len(fixed) < len(parts) else os.path.dirname(pattern)
    matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    if not matches:
        raise DataError(
            f"files={pattern!r} matches no files; pass a glob of existing text "
            "files, e.g. files='/data/books/**/*.txt'"
        )
    return root, sorted(_relative(p, root) for p in matches)


def fingerprint(root: str, relpaths: list[str]) -> str:
    """Returns a SHA-256 hex digest over the relative paths and file contents."""
    digest = hashlib.sha256()
    for relpath in sorted(relpaths):
        content = hashlib.sha256(Path(root, relpath).read_bytes()).hexdigest()
        digest.update(f"{relpath}\0{content}\n".encode())
    return digest.hexdigest()


def _relative(path: str, root: str) -> str:
    return PurePath(os.path.relpath(path, root)).as_posix()


class _FileCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """One document per file: {'text': file bytes, 'path': path relative to the root}."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {
        "1.0.0": "One document per file; 90/5/5 split by SHA-256 of the relative path."
    }

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)

    # TFDS looks beside a builder's source file for checksums and metadata
    # files; these builders download nothing and have none. Saying so also
    # skips tfds 4.9.10's import of the undeclared `importlib_resources`
    # package on that path (tensorflow/datasets#11212).
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return None

    def list_files(self) -> tuple[str, list[str]]:
        """Returns (root, relative paths) of the input files."""
        raise NotImplementedError

    # TFDS announces a download ("Downloading and preparing dataset Unknown
    # size ...") and its end; nothing is downloaded here and prepare() says
    # what it builds in one line.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing is downloaded.
        root, relpaths = self.list_files()
        self.info.metadata["source_fingerprint"] = fingerprint(root, relpaths)
        self.info.metadata["num_files"] = len(relpaths)
        by_split = {split: [] for split in SPLITS}
        for relpath in relpaths:
            by_split[split_of(relpath)].append(relpath)
        return {
            split: self._generate_examples(root, files)
            for split, files in by_split.items()
            if files
        }

    def _generate_examples(self, root, relpaths):
        for relpath in relpaths:
            yield relpath, {"text": Path(root, relpath).read_bytes(), "path": relpath}


def _python_tag() -> str:
    """The running interpreter, e.g. 'cpython3_11_7': its stdlib is this corpus."""
    v = sys.version_info
    return f"{sys.implementation.name}{v.major}_{v.minor}_{v.micro}"


class PythonStdlib(_FileCorpus):
    """The .py files of the running Python's standard library (no tests, no site-packages).

    One build per interpreter (a TFDS config named after it, so the data lives in
    ``python_stdlib/<tag>/<version>``): Pythons of other versions sharing a cache
    directory each read their own standard library.
    """

    name = "python_stdlib"
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=_python_tag())]

    def __init__(self, *, max_files: int | None = None, **kwargs):
        self._max_files = max_files
        super().__init__(**kwargs)

    def list_files(self):
        return stdlib_files(self._max_files)


class TextFiles(_FileCorpus):
    """The files matching a glob, given as `files=`."""

    name = "textfiles"

    def __init__(self, *, files: str | None = None, **kwargs):
        self._files = files
        super().__init__(**kwargs)

    def list_files(self):
        if self._files is None:
            raise DataError("textfiles needs files='<glob>' to build, e.g. files='/data/**/*.txt'")
        return glob_files(self._files)


def prepare(
    name: str,
    data_dir: str | os.PathLike | None = None,
    files: str | None = None,
    *,
    max_files: int | None = None,
    overwrite: bool = False,
) -> tfds.core.DatasetBuilder:
    """Builds `python_stdlib` or `textfiles` into data_dir once; later calls reuse it.

    An existing build is checked against the input files' fingerprint: for
    `python_stdlib` always, for `textfiles` when `files` is given (without it the
    prepared data is read as is). A mismatch raises DataError unless
    `overwrite=True`, which deletes the old build and writes a new one.
    """
    data_dir = resolve_data_dir(data_dir)
    if name == "python_stdlib":
        if files is not None:
            raise DataError("files= applies to 'textfiles' only; drop it for 'python_stdlib'")
        make = functools.partial(PythonStdlib, data_dir=data_dir, max_files=max_files)
    elif name == "textfiles":
        if max_files is not None:
            raise DataError(
                "max_files= applies to 'python_stdlib' only; narrow the files= glob instead"
            )
        if files is not None:
            glob_files(files)  # Fail on a bad glob before touching data_dir.
        make = functools.partial(TextFiles, data_dir=data_dir, files=files)
    else:
        raise DataError(
            f"prepare() builds {BUILDER_NAMES}, not {name!r}; "
            "prepare other datasets with `tfds build`"
        )

    with _quiet_tfds():  # is_prepared() warns about a version folder not written yet
        builder = make()
        if overwrite and builder.is_prepared():
            shutil.rmtree(builder.data_path)
            builder = make()
        prepared = builder.is_prepared()
    if not prepared:
        if name == "textfiles" and files is None:
            raise DataError(
                f"textfiles is not prepared in {data_dir}; pass files='<glob>' "
                "(e.g. files='/data/**/*.txt') to build it"
            )
        _, relpaths = builder.list_files()
        print(f"building dataset {name} ({len(relpaths)} files)...", end="", flush=True)
        with _quiet_tfds():
            builder.download_and_prepare()
        print(" done", flush=True)
        return builder
    if name == "python_stdlib" or files is not None:
        stored = builder.info.metadata.get("source_fingerprint")
        current = fingerprint(*builder.list_files())
        if stored != current:
            raise DataError(
                f"{name} in {builder.data_path} was built from other files than "
                f"the current ones (fingerprint {str(stored)[:12]} vs {current[:12]}); "
                f"delete {builder.data_path} (overwrite=True in prepare()) to rebuild it, or "
                "use another data_dir"
            )
    return builder


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

    def __getitem__(self, index: int) -> bytes:
        text = self._records[index][self._text_feature]
        return text.encode("utf-8") if isinstance(text, str) else bytes(text)

    def __repr__(self) -> str:
        return f"TextSource({self._records!r}, text_feature={self._text_feature!r})"


def load_source(
    name: str,
    split: str,
    data_dir: str | os.PathLike | None = None,
    files: str | None = None,
    *,
    text_feature: str = "text",
    max_files: int | None = None,
) -> TextSource:
    """Returns a random-access TextSource over one split of a TFDS dataset.

    `python_stdlib` and `textfiles` are built on first use (see `prepare`);
    any other name must already be prepared as ArrayRecord in data_dir.
    `split` accepts the TFDS split syntax ('train', 'validation[:10%]', ...).
    """
    data_dir = resolve_data_dir(data_dir)
    if name in BUILDER_NAMES:
        prepare(name, data_dir, files, max_files=max_files)
    elif files is not None or max_files is not None:
        raise DataError(f"files=/max_files= apply to {BUILDER_NAMES} only, not {name!r}")
    else:
        base = name.split(":")[0]
        if not glob.glob(os.path.join(data_dir, base, "**", "dataset_info.json"), recursive=True):
            raise DataError(
                f"dataset {name!r} is not prepared in {data_dir}; run `tfds build {base} "
                f"--file_format=array_record --data_dir={data_dir}` or use one of {BUILDER_NAMES}"
            )
    try:
        records = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except (ValueError, KeyError, NotImplementedError, FileNotFoundError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot read split {split!r} of {name!r} from {data_dir}: {reason}") from e
    features = records.dataset_info.features
    if text_feature not in features:
        raise DataError(
            f"{name!r} has no feature {text_feature!r}; "
            f"pass text_feature= one of {sorted(features.keys())}"
        )
    return TextSource(records, text_feature)

"""lexjax.data: tokenizer, TF-less TFDS builders, grain packing pipeline."""

import base64
import collections
import contextlib
import glob
import hashlib
import itertools
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from lexjax import data, errors
from lexjax.data import builders
from lexjax.data import tokenizer as tokenizer_lib
from lexjax.errors import DataError

SEQ_LEN = 32


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 𝄞", "a\nb\tc\0d"])
def test_tokenizer_round_trip(text):
    ids = data.encode(text)
    assert ids.dtype == np.int32
    assert data.decode(ids) == text
    document = data.encode_document(text)
    assert document.dtype == np.int32
    assert document[0] == data.BOS and document[-1] == data.EOS
    np.testing.assert_array_equal(document[1:-1], ids)
    assert data.decode(document) == text


def test_tokenizer_keeps_every_byte_including_invalid_utf8():
    every_byte = bytes(range(256)) + b"\xff\xfe\xc3"
    ids = data.encode(every_byte)
    assert bytes(ids.astype(np.uint8)) == every_byte
    assert data.decode(data.encode(b"ok\xffok")) == "ok\ufffdok"
    assert data.encode(b"").shape == (0,)
    np.testing.assert_array_equal(data.encode_document(b""), [data.BOS, data.EOS])
    assert data.VOCAB_SIZE == 258 and max(data.BOS, data.EOS) < data.VOCAB_SIZE


# ---------------------------------------------------------------- builders


def _write_corpus(root, count):
    """Writes `count` text files, renaming until every split has at least one."""
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)
    names, i = [], 0
    while len(names) < count or {builders.split_of(n) for n in names} != set(data.SPLITS):
        name = f"sub/doc{i:03d}.txt" if i % 3 else f"doc{i:03d}.txt"
        names.append(name)
        i += 1
    for n, name in enumerate(names):
        text = f"document {name}\n" + "lorem ipsum " * (n % 7) + "\xe9\n"
        with open(os.path.join(root, name), "wb") as f:
            f.write(text.encode("utf-8") + (b"\xff" if n % 5 == 0 else b""))
    return sorted(names)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small textfiles corpus, built once into its own data dir."""
    root = str(tmp_path_factory.mktemp("corpus"))
    names = _write_corpus(root, 30)
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    pattern = os.path.join(root, "**", "*.txt")
    data.prepare("textfiles", data_dir, pattern)
    return {"root": root, "names": names, "data_dir": data_dir, "pattern": pattern}


def test_textfiles_write_array_record_and_read_back_without_tensorflow(corpus):
    builder = data.prepare("textfiles", corpus["data_dir"], corpus["pattern"])
    assert glob.glob(os.path.join(builder.data_path, "textfiles-train.array_record-*"))
    seen = {}
    for split in data.SPLITS:
        records = builder.as_data_source(split)
        for i in range(len(records)):
            example = records[i]
            path = example["path"].decode()
            assert builders.split_of(path) == split
            seen[path] = example["text"]
    assert sorted(seen) == corpus["names"]
    for path, text in seen.items():
        with open(os.path.join(corpus["root"], path), "rb") as f:
            assert text == f.read().decode("utf-8", errors="replace").encode()
    assert "tensorflow" not in sys.modules


def test_text_source_is_raw_bytes(corpus):
    source = data.load_source("textfiles", "train", corpus["data_dir"], corpus["pattern"])
    assert len(source) == sum(builders.split_of(n) == "train" for n in corpus["names"])
    assert all(isinstance(source[i], bytes) for i in range(len(source)))
    assert "tensorflow" not in sys.modules


def test_sources_pickle_for_grain_worker_processes(corpus, tmp_path):
    """grain hands the source to its worker processes pickled (data.worker_count >= 1);
    TFDS pickles a builder as its base arguments, which cannot make a corpus builder."""
    sources = [
        data.load_source("textfiles", "train", corpus["data_dir"], corpus["pattern"]),
        data.load_source("python_stdlib", "train", tmp_path, max_files=12),
    ]
    for source in sources:
        copy = pickle.loads(pickle.dumps(source))
        assert copy.build == source.build
        assert [copy[i] for i in range(len(copy))] == [source[i] for i in range(len(source))]


def test_split_is_stable_disjoint_and_roughly_90_5_5():
    paths = [f"pkg{i // 50}/module_{i}.py" for i in range(4000)]
    first = [builders.split_of(p) for p in paths]
    assert first == [builders.split_of(p) for p in paths]
    counts = collections.Counter(first)
    assert set(counts) == set(data.SPLITS)
    assert 0.87 < counts["train"] / len(paths) < 0.93
    assert 0.03 < counts["validation"] / len(paths) < 0.07
    # 5% each, closely: over 40,000 paths a 5% share lies within ±0.5% (4.5 standard
    # deviations); a bucket of 6% (or 4%) for one held-out split does not.
    many = collections.Counter(builders.split_of(f"d{i // 100}/f{i}.txt") for i in range(40_000))
    for split in ("validation", "test"):
        assert 0.045 < many[split] / 40_000 < 0.055, many
    # Pinned: SHA-256 buckets do not depend on the run, machine or PYTHONHASHSEED.
    assert [builders.split_of(p) for p in ("os.py", "m30.py", "asyncio/tasks.py")] == [
        "validation",
        "test",
        "train",
    ]


def test_python_stdlib_builds_once_and_reuses(tmp_path):
    source = data.load_source("python_stdlib", "train", tmp_path, max_files=12)
    array_records = glob.glob(str(tmp_path / "python_stdlib" / "*" / "2.0.0" / "*.array_record-*"))
    assert array_records
    mtimes = {p: os.stat(p).st_mtime_ns for p in array_records}
    root, relpaths = builders.stdlib_files(12)
    assert len(source) == len(data.plan_corpus("python_stdlib", max_files=12).pieces["train"])
    assert all(not part.startswith("site-packages") for p in relpaths for part in p.split("/"))
    source_again = data.load_source("python_stdlib", "train", tmp_path, max_files=12)
    assert len(source_again) == len(source)
    assert {p: os.stat(p).st_mtime_ns for p in array_records} == mtimes
    assert "tensorflow" not in sys.modules


def test_python_stdlib_leaves_out_a_link_to_nothing(tmp_path, monkeypatch):
    """A stdlib file that links to nothing (Debian's sitecustomize.py, whose /etc
    target a slimmed image removed) is left out, as a files= glob leaves it out: it
    was a FileNotFoundError traceback from the README's first command."""
    stdlib = tmp_path / "lib"
    (stdlib / "email").mkdir(parents=True)
    (stdlib / "abc.py").write_text("x = 1\n")
    (stdlib / "email" / "utils.py").write_text("y = 2\n")
    (stdlib / "sitecustomize.py").symlink_to(tmp_path / "etc" / "sitecustomize.py")
    (stdlib / "linked.py").symlink_to(stdlib / "abc.py")  # a link to a file stays
    monkeypatch.setattr(builders.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    root, relpaths = builders.stdlib_files()
    assert root == str(stdlib) and relpaths == ["abc.py", "email/utils.py", "linked.py"]
    for i in range(20):  # enough files to plan the three splits
        (stdlib / f"m{i:02d}.py").write_text(f"value_{i} = {i}\n" * 40)
    planned = data.plan_corpus("python_stdlib").pieces.values()
    assert "m00.py" in {p.relpath for pieces in planned for p in pieces}


def test_one_build_per_corpus_and_a_changed_file_gets_a_new_one(tmp_path):
    root, other, data_dir = tmp_path / "corpus", tmp_path / "other", tmp_path / "tfds"
    names = _write_corpus(str(root), 5)
    _write_corpus(str(other), 5)
    (other / "extra.txt").write_text("one more file\n")
    pattern, other_pattern = str(root / "**" / "*.txt"), str(other / "**" / "*.txt")
    first = data.prepare("textfiles", data_dir, pattern)
    second = data.prepare("textfiles", data_dir, other_pattern)
    assert first.data_path != second.data_path  # two corpora coexist, nothing deleted
    assert data.prepare("textfiles", data_dir, pattern).data_path == first.data_path
    (root / names[0]).write_bytes(b"edited")
    edited = data.prepare("textfiles", data_dir, pattern)
    assert edited.data_path not in (first.data_path, second.data_path)
    for builder in (first, second, edited):
        assert builder.is_prepared()
    assert len([p for p in (data_dir / "textfiles").iterdir() if p.is_dir()]) == 3


_PREPARE_AT_A_SIGNAL = """
import os, sys, time
from lexjax import data
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):  # every process imports first, then all start at once
    time.sleep(0.005)
print(data.prepare("textfiles", sys.argv[2], sys.argv[3]).data_path, flush=True)
"""


def test_processes_preparing_one_corpus_at_once_build_it_once(tmp_path):
    """Before the build lock, all but the first to finish failed renaming their
    build onto the first's (FileExistsError)."""
    _write_corpus(str(tmp_path / "corpus"), 60)
    go, data_dir = tmp_path / "go", tmp_path / "tfds"
    args = [sys.executable, "-c", _PREPARE_AT_A_SIGNAL, str(go), str(data_dir)]
    args.append(str(tmp_path / "corpus" / "**" / "*.txt"))
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 3
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1 and os.path.isdir(paths.pop())
    assert sum(out.count("building dataset") for out, _ in outputs) == 1


def test_a_process_waiting_for_anothers_build_says_so(tmp_path):
    """It waited in silence for as long as the other process's build took."""
    import fcntl
    import select

    _write_corpus(str(tmp_path / "corpus"), 60)
    files, data_dir = str(tmp_path / "corpus" / "**" / "*.txt"), tmp_path / "tfds"
    fingerprint = data.plan_corpus("textfiles", files).fingerprint
    (data_dir / "textfiles").mkdir(parents=True)
    with open(data_dir / "textfiles" / f".{fingerprint[:16]}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building
        script = "import sys; from lexjax import data; data.prepare('textfiles', *sys.argv[1:])"
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(data_dir), files],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = select.select([proc.stdout], [], [], 60)[0]  # (silent: it never says it)
        said = proc.stdout.readline() if ready else "nothing in 60 s"
        assert said == f"waiting for another process's build of dataset textfiles in {data_dir}\n"
    out, err = proc.communicate(timeout=120)  # the lock released: its own build
    assert proc.returncode == 0 and out.startswith("building dataset textfiles"), err[-2000:]


def test_a_build_killed_midway_leaves_nothing_after_the_next_one(tmp_path):
    """TFDS writes a build into ``incomplete.<random>_2.0.0`` and renames it when done;
    one killed midway (SIGKILL) left that partial copy of the corpus for good beside
    every later build. A use of the corpus removes it once an hour untouched: the
    rebuild, or a later use where the rebuild came sooner."""
    _write_corpus(str(tmp_path / "corpus"), 20)
    files, data_dir = str(tmp_path / "corpus" / "**" / "*.txt"), tmp_path / "tfds"
    home = data_dir / "textfiles" / data.plan_corpus("textfiles", files).fingerprint[:16]
    dead = home / "incomplete.K1LL3D_2.0.0" / "textfiles-train.array_record-00000-of-00001"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"half a shard")
    two_hours_ago = time.time() - 7200
    for path in (dead, dead.parent):
        os.utime(path, (two_hours_ago, two_hours_ago))
    # Written a moment ago: maybe another host's build under a per-host flock, left.
    live = home / "incomplete.L1V3ON_2.0.0"
    (live / "shard").mkdir(parents=True)
    other = data_dir / "textfiles" / "0123456789abcdef" / "incomplete.OTHER1_2.0.0"
    other.mkdir(parents=True)  # another corpus's: its own lock decides, not this build
    builder = data.prepare("textfiles", str(data_dir), files)
    assert sorted(p.name for p in home.iterdir()) == ["2.0.0", live.name]
    assert builder.is_prepared() and other.exists()
    # The one a rebuild within the hour kept goes at a later use (the build is made).
    os.utime(live / "shard", (two_hours_ago, two_hours_ago))
    os.utime(live, (two_hours_ago, two_hours_ago))
    data.prepare("textfiles", str(data_dir), files)
    assert sorted(p.name for p in home.iterdir()) == ["2.0.0"]


def test_runs_sharing_a_data_dir_learn_its_tokenizer_once(tmp_path):
    """Two runs started at once on one corpus both learned its SentencePiece model
    (minutes each on a large corpus). The second now waits, saying so, and reads it."""
    import fcntl
    import select

    _write_corpus(str(tmp_path / "corpus"), 60)
    files, data_dir = str(tmp_path / "corpus" / "**" / "*.txt"), tmp_path / "tfds"
    build = data.prepare("textfiles", data_dir, files).data_path
    model = os.path.join(build, "sentencepiece-300.model")
    script = (
        "import sys; from lexjax import data\n"
        "data.load_tokenizer('sentencepiece', 300, 'textfiles', *sys.argv[1:])"
    )
    with open(os.path.join(build, ".sentencepiece-300.model.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run learning it
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(data_dir), files],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = select.select([proc.stdout], [], [], 60)[0]
        said = proc.stdout.readline() if ready else "nothing in 60 s"
        assert said == f"waiting for another process's sentencepiece tokenizer {model}\n"
        # This test is that run: it learns and stores it as load_tokenizer does.
        learned = builders._learn_tokenizer(model, 300, "textfiles", data_dir, files)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == "", (out, err[-2000:])  # read, not learned again
    assert (
        learned.describe()
        == data.load_tokenizer(
            "sentencepiece", 300, "textfiles", data_dir, files, train=False
        ).describe()
    )


# A script's start: SIGTERM raises Stopped, as in train() while it sets up, and one
# that a callback swallowed (TFDS's, a __del__) comes again, as train() has it.
_STOP_ON_SIGTERM = """
import shutil
import signal
from lexjax import signals

class Stopped(BaseException):
    pass

def stop(signum, frame):
    raise Stopped

signal.signal(signal.SIGTERM, stop)
signals.on_swallowed(Stopped, lambda: signals.interrupt_main_later(signal.SIGTERM))
"""

_BUILD_UNTIL_SIGTERM = (
    _STOP_ON_SIGTERM
    + """
import sys
from lexjax import data
try:
    data.prepare("textfiles", sys.argv[1], sys.argv[2])
except Stopped:
    print("stopped", flush=True)
"""
)


def test_a_signal_while_the_corpus_builds_ends_the_building_line(tmp_path):
    """The run's own line came after "building dataset …..." on the same line."""
    _write_corpus(str(tmp_path / "corpus"), 60)
    args = [sys.executable, "-c", _BUILD_UNTIL_SIGTERM, str(tmp_path / "tfds")]
    args.append(str(tmp_path / "corpus" / "**" / "*.txt"))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    seen = ""
    while not seen.endswith("..."):
        seen += proc.stdout.read(1) or pytest.fail(f"no building line: {seen!r}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert seen.startswith("building dataset textfiles (60 files")
    assert (out, proc.returncode) == ("\nstopped\n", 0)


def test_builds_leave_no_temporary_directories(tmp_path, monkeypatch):
    """TFDS's bucket lookup made an empty tmpXXXXtfds in $TMPDIR for every build."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    root = tmp_path / "corpus"
    _write_corpus(str(root), 4)
    data.load_source("textfiles", "train", tmp_path / "tfds", str(root / "**" / "*.txt"))
    assert os.listdir(scratch) == []


def test_building_a_corpus_is_one_plain_line(tmp_path, capfd):
    """No TFDS progress bars (escape codes in logs), no download banner for a local
    corpus, no warnings about the folder being written: one line saying what is built."""
    root = tmp_path / "corpus"
    names = _write_corpus(str(root), 5)
    data.load_source("textfiles", "train", tmp_path / "tfds", str(root / "**" / "*.txt"))
    out, err = capfd.readouterr()
    where = tmp_path / "tfds"  # said: a copied run's stored data_dir may be another's
    line = f"building dataset textfiles ({len(names)} files, split by file) in {where}... done"
    invalid = len(range(0, len(names), 5))  # _write_corpus ends every fifth file with 0xFF
    replaced = f"; {invalid} file{'s' * (invalid != 1)} had invalid UTF-8, replaced by U+FFFD"
    assert out.splitlines() == [line + replaced], out
    assert err == "", err
    locks = list((where / "textfiles").glob(".*.lock"))  # the build's lock: was executable
    assert locks and all(lock.stat().st_mode & 0o111 == 0 for lock in locks)
    data.load_source("textfiles", "validation", tmp_path / "tfds", str(root / "**" / "*.txt"))
    assert capfd.readouterr() == ("", "")  # built once


def test_a_file_name_that_is_not_utf8_builds_under_an_escaped_name(tmp_path):
    """A Latin-1 name (``caf\\xe9.txt``, as in old archives) is read and stored as
    ``caf\\xe9.txt`` instead of stopping the build with a traceback."""
    root = tmp_path / "corpus"
    names = _write_corpus(str(root), 12)
    with open(os.path.join(os.fsencode(root), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 named text\n" * 20)
    builder = data.prepare("textfiles", tmp_path / "tfds", str(root / "**" / "*.txt"))
    stored = {}
    for split in data.SPLITS:
        records = builder.as_data_source(split)
        for i in range(len(records)):
            stored[records[i]["path"].decode()] = records[i]["text"]
    assert sorted(stored) == sorted([*names, "caf\\xe9.txt"])
    assert stored["caf\\xe9.txt"] == b"latin-1 named text\n" * 20
    assert builders.split_of("caf\udce9.txt") == builders.split_of("caf\\xe9.txt")


class _ForeignCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Stands in for a TFDS catalog dataset (e.g. pg19) prepared as ArrayRecord elsewhere."""

    name = "foreign_corpus"
    VERSION = tfds.core.Version("2.0.0")

    def _info(self):
        features = {"content": tfds.features.Text(), "label": tfds.features.Scalar(np.int64)}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(6)}

    def _generate_examples(self, count):
        for i in range(count):
            yield i, {"content": f"book {i}", "label": i}


def test_other_prepared_datasets_load_through_tfds_data_source(tmp_path):
    _ForeignCorpus(data_dir=tmp_path, file_format="array_record").download_and_prepare()
    source = data.load_source("foreign_corpus", "train", tmp_path, text_feature="content")
    assert sorted(source[i] for i in range(len(source))) == [f"book {i}".encode() for i in range(6)]
    assert (
        len(data.load_source("foreign_corpus", "train[:50%]", tmp_path, text_feature="content"))
        == 3
    )
    with pytest.raises(DataError, match=r"set data.text_feature to one of \['content'\]$"):
        data.load_source("foreign_corpus", "train", tmp_path)
    assert "tensorflow" not in sys.modules


def test_bad_input_says_what_to_change(tmp_path):
    with pytest.raises(DataError, match="matches no files") as e:
        data.load_source("textfiles", "train", tmp_path, str(tmp_path / "nothing" / "*.txt"))
    assert "\n" not in str(e.value)
    with pytest.raises(DataError) as e:
        data.plan_corpus("textfiles", str(tmp_path), test_files=str(tmp_path / "nothing"))
    assert str(e.value) == (
        f"data.test_files={str(tmp_path / 'nothing')!r} matches no files; pass a glob of "
        "existing text files, e.g. data.test_files='/data/books/**/*.txt'"
    )
    with pytest.raises(DataError) as e:  # a directory: say how to take its files
        data.plan_corpus("textfiles", str(tmp_path))
    assert str(e.value) == (
        f"data.files={str(tmp_path)!r} matches no files; it is a directory: pass a glob of its "
        f"files, e.g. {tmp_path}/** or {tmp_path}/*.txt"
    )
    # A directory named with '[': glob read "[2024]" as one of the characters 2, 0, 4.
    books = tmp_path / "[2024] books"
    books.mkdir()
    (books / "one.txt").write_text("a book\n")
    pattern = str(books / "**" / "*.txt")
    with pytest.raises(DataError) as e:
        data.plan_corpus("textfiles", pattern)
    escaped = os.path.join(str(tmp_path), "[[]2024] books", "**", "*.txt")
    assert str(e.value) == (
        f"data.files={pattern!r} matches no files; a directory or file name in it holds "
        f"'[', which glob reads as a set of characters; escape it: data.files='{escaped}'"
    )
    assert builders.glob_files(escaped)[1] == ["[2024] books/one.txt"]  # the advice works
    # A shell's braces, quoted: glob read them as literal characters.
    braces = str(tmp_path / "{a,b}" / "*.txt")
    with pytest.raises(DataError) as e:
        data.plan_corpus("textfiles", braces)
    assert str(e.value) == (
        f"data.files={braces!r} matches no files; a glob does not expand {{a,b}} as a shell "
        "does; pass one glob that matches every file, such as their common directory's "
        "/**/*.txt"
    )
    with pytest.raises(DataError, match="tfds build pg19 --file_format=array_record"):
        data.load_source("pg19", "train", tmp_path)
    with pytest.raises(DataError, match="^data.files is read by data.name=textfiles only; set"):
        data.plan_corpus("python_stdlib", pattern)  # it said to drop the files
    with pytest.raises(DataError, match="textfiles needs files="):
        data.load_source("textfiles", "train", tmp_path)
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    (tmp_path / "blocker").write_text("")
    with pytest.raises(DataError, match=r"cannot create .*blocker/data.* \(Not a directory\)"):
        data.load_source(
            "textfiles", "train", tmp_path / "blocker" / "data", str(tmp_path / "a.txt")
        )


def test_unknown_split_and_feature(corpus):
    with pytest.raises(DataError, match="Unknown split"):
        data.load_source("textfiles", "training", corpus["data_dir"], corpus["pattern"])
    with pytest.raises(DataError, match="text_feature"):
        data.load_source(
            "textfiles", "train", corpus["data_dir"], corpus["pattern"], text_feature="body"
        )


# ---------------------------------------------------------------- pipeline


def _documents(count=80):
    """Distinct documents of varied length; some longer than SEQ_LEN."""
    return [f"<{i}>" + "xyz!" * (i % 19) for i in range(count)]


def _chunks(documents, seq_len=SEQ_LEN):
    """All (inputs, targets) chunks of the packing convention, as tuples."""
    chunks = collections.Counter()
    for text in documents:
        d = data.encode_document(text)
        for start in range(0, len(d) - 1, seq_len):
            chunks[
                tuple(d[:-1][start : start + seq_len]), tuple(d[1:][start : start + seq_len])
            ] += 1
    return chunks


def _segments(batch):
    """Yields (inputs, targets, positions) of every packed segment in a batch."""
    for row in range(batch["inputs"].shape[0]):
        segment_ids = batch["segment_ids"][row]
        for segment in np.unique(segment_ids[segment_ids > 0]):
            where = segment_ids == segment
            yield (
                batch["inputs"][row][where],
                batch["targets"][row][where],
                batch["positions"][row][where],
            )


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def test_batch_shapes_and_dtypes():
    batch = next(data.make_train_iterator(_documents(), seq_len=SEQ_LEN, batch_size=4, seed=0))
    assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets"]
    for value in batch.values():
        assert isinstance(value, np.ndarray)
        assert value.shape == (4, SEQ_LEN) and value.dtype == np.int32


def test_pipeline_is_deterministic_for_a_seed():
    make = lambda seed: data.make_train_iterator(
        _documents(), seq_len=SEQ_LEN, batch_size=4, seed=seed
    )
    _assert_batches_equal(_take(make(7), 6), _take(make(7), 6))
    other = _take(make(8), 6)
    assert any(
        not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(_take(make(7), 6), other)
    )


def test_the_largest_seed_streams_past_many_shuffle_windows():
    """grain seeds shuffle window w with seed + w, a 32-bit seed: seed 2**32 - 1 (allowed)
    ended in a TypeError at its second window, and 2**32 - k after about k windows."""
    for seed in (2**32 - 1, 2**32 - 2):
        it = data.make_train_iterator(
            _documents(), seq_len=SEQ_LEN, batch_size=2, seed=seed, shuffle_rows=2
        )
        assert len(_take(it, 12)) == 12  # 24 rows: 12 windows of 2


def test_packing_convention():
    documents = _documents()
    expected = _chunks(documents)
    seen = collections.Counter()
    for batch in data.make_train_iterator(
        documents, seq_len=SEQ_LEN, batch_size=3, seed=1, num_epochs=1
    ):
        # Every batch is whole: the last incomplete one is dropped (the rows do not
        # divide by 3 here), not yielded short to be stacked on a mesh of 3 rows.
        assert all(value.shape == (3, SEQ_LEN) for value in batch.values())
        padding = batch["segment_ids"] == 0
        assert not batch["inputs"][padding].any() and not batch["targets"][padding].any()
        assert not batch["positions"][padding].any()
        for row in batch["segment_ids"]:
            used = row[row > 0]
            # Segments are numbered 1, 2, 3, ... left to right, padding only at the end.
            np.testing.assert_array_equal(np.unique(used), np.arange(1, used.max() + 1))
            assert np.all(np.diff(used) >= 0) and not row[len(used) :].any()
        for inputs, targets, positions in _segments(batch):
            np.testing.assert_array_equal(positions, np.arange(len(inputs)))
            np.testing.assert_array_equal(targets[:-1], inputs[1:])
            seen[tuple(inputs), tuple(targets)] += 1
    # Every segment is a chunk of some document, cut at a multiple of seq_len
    # (so a document continuing past a row restarts at position 0), none twice.
    assert not seen - expected
    assert sum(seen.values()) > 0.8 * sum(expected.values())


def test_long_document_continues_as_new_segments():
    document = data.encode_document("a" * (3 * SEQ_LEN + 5))
    batches = list(
        data.make_train_iterator(
            [document], seq_len=SEQ_LEN, batch_size=1, seed=0, num_epochs=1, shuffle_rows=0
        )
    )
    assert len(batches) == 4
    for i, batch in enumerate(batches):
        start = i * SEQ_LEN
        length = min(SEQ_LEN, len(document) - 1 - start)
        np.testing.assert_array_equal(
            batch["inputs"][0, :length], document[:-1][start : start + length]
        )
        np.testing.assert_array_equal(
            batch["targets"][0, :length], document[1:][start : start + length]
        )
        np.testing.assert_array_equal(batch["positions"][0, :length], np.arange(length))
        np.testing.assert_array_equal(batch["segment_ids"][0, :length], 1)
        assert not batch["segment_ids"][0, length:].any()


def test_row_shuffle_mixes_documents_into_batches_and_keeps_every_row():
    """Packing emits a long document's rows one after another; the shuffle window
    spreads them over batches, and a pass over the data still holds every row once."""
    letters = "abcdefgh"
    documents = [letter * (8 * SEQ_LEN - 1) for letter in letters]  # 8 full rows each

    def rows(shuffle_rows):
        it = data.make_train_iterator(
            documents,
            seq_len=SEQ_LEN,
            batch_size=4,
            seed=1,
            num_epochs=1,
            shuffle_rows=shuffle_rows,
            open_documents=1,  # The row shuffle alone.
        )
        return [batch["targets"][:, 1:] for batch in it]

    def letters_per_batch(batches):
        return [len({bytes(row[:1]) for row in batch}) for batch in batches]

    plain, shuffled = rows(0), rows(64)
    assert sorted(r.tobytes() for b in plain for r in b) == sorted(
        r.tobytes() for b in shuffled for r in b
    )
    assert np.mean(letters_per_batch(plain)) < 1.5  # mostly one document per batch
    assert np.mean(letters_per_batch(shuffled)) > 2.5


def _book_and_pages(book_rows=64, pages=40):
    """One document of `book_rows` full rows ("B" * ...) and `pages` documents of
    one full row each (other letters): d = [BOS, text, EOS] has SEQ_LEN pairs
    per row when the text has rows * SEQ_LEN - 1 bytes."""
    pages = [chr(ord("a") + i % 26) * (SEQ_LEN - 1) for i in range(pages)]
    return ["B" * (book_rows * SEQ_LEN - 1)] + pages


def _row_letters(iterator, batches):
    """The letter each row of the next `batches` batches is made of (its second target)."""
    return [chr(row[1]) for batch in _take(iterator, batches) for row in batch["targets"]]


def test_open_documents_spread_a_book_longer_than_the_shuffle_window():
    """A book longer than the row shuffle window filled whole windows, so whole
    batches, by itself; with chunks taken in turn from four open documents the
    book gives one row in four while pages remain to take turns (the packer's
    four bins may swap neighbours: runs of two)."""

    def book_runs(open_documents):
        it = data.make_train_iterator(
            _book_and_pages(book_rows=64, pages=400),
            seq_len=SEQ_LEN,
            batch_size=4,
            seed=1,
            shuffle_rows=0,
            open_documents=open_documents,
        )
        letters = "".join(_row_letters(it, 116))  # 464 rows: one pass over the data
        assert letters.count("B") == 64
        return max(len(run) for run in re.findall("B+", letters))

    assert book_runs(1) >= 48
    assert book_runs(4) <= 2


@pytest.mark.parametrize("taken", [9, 17])
def test_resume_inside_open_documents_equals_uninterrupted(taken):
    """A state saved while the book and pages are half read restores them."""
    documents = _book_and_pages(book_rows=20, pages=12)
    # The book's bytes vary, so a chunk read from another offset is other bytes (of
    # "BBB…" every offset read the same and a resume one byte off went unseen).
    documents[0] = bytes(33 + i % 89 for i in range(len(documents[0])))
    make = lambda: data.make_train_iterator(
        documents, seq_len=SEQ_LEN, batch_size=2, seed=7, shuffle_rows=3, open_documents=3
    )
    iterator = make()
    _take(iterator, taken)
    state = json.loads(json.dumps(iterator.get_state()))
    assert any(slot and slot[1] for slot in _find(state, "slots")), "no half-read document"
    uninterrupted = _take(iterator, 12)
    resumed = make()
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 12), uninterrupted)


def _find(state, key):
    """The value under `key` anywhere in a nested iterator state."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            if (found := _find(value, key)) is not None:
                return found
    return None


def _shards(count, worker_count=0):
    """Shards 0..count-1 of one global stream of 4-row batches, as processes build them."""
    return [
        data.make_train_iterator(
            _documents(40),
            seq_len=SEQ_LEN,
            batch_size=4,
            seed=3,
            shard_index=i,
            shard_count=count,
            worker_count=worker_count,
        )
        for i in range(count)
    ]


def _assert_rows_of(shards, global_batches):
    """Shard i of n yields rows [i*b, (i+1)*b), b = 4/n, of each global batch."""
    rows = 4 // len(shards)
    for i, it in enumerate(shards):
        expected = [{k: v[i * rows : (i + 1) * rows] for k, v in b.items()} for b in global_batches]
        _assert_batches_equal(_take(it, len(global_batches)), expected)


def _state(iterator) -> str:
    return json.dumps(iterator.get_state(), sort_keys=True)


def test_shards_split_one_global_stream():
    """1, 2 and 4 shards (processes) yield the rows of the same global batches, each
    shard its own block; their states are equal, so a position saved by a shard of 2
    restores every shard of 4, and of 1 (elastic resume)."""
    (one,), two, four = _shards(1), _shards(2), _shards(4)
    global_batches = _take(one, 5)
    _assert_rows_of(two, global_batches)
    _assert_rows_of(four, global_batches)
    assert len({_state(it) for it in (one, *two, *four)}) == 1
    saved = json.loads(json.dumps(two[1].get_state()))  # checkpoints store it as JSON
    after = _take(one, 3)
    for resumed in (_shards(4), _shards(1)):
        for it in resumed:
            it.set_state(saved)
        _assert_rows_of(resumed, after)


class _ProcessView:
    """``sharding`` as process ``index`` of ``count`` sees it: each process holds an
    equal run of the mesh's devices in order (as on hosts of one slice), only those
    addressable."""

    def __init__(self, sharding, index, count):
        devices = list(sharding.mesh.devices.flat)
        per = len(devices) // count
        self.sharding, self.mine = sharding, set(devices[index * per : (index + 1) * per])

    def addressable_devices_indices_map(self, shape):
        indices = self.sharding.devices_indices_map(shape)
        return {d: i for d, i in indices.items() if d in self.mine}


@pytest.mark.parametrize("processes,batch_size", [(2, 8), (4, 16), (8, 8)])
def test_each_process_feeds_the_rows_its_devices_hold(processes, batch_size):
    """A batch split over all 8 devices, held by 2, 4 or 8 processes of equal
    device runs: process i feeds rows [i*b, (i+1)*b), b = batch_size / processes
    (hand-worked: its devices are the i-th run), and the pipeline's shards of
    those (index, count) put together give the global batch, no row twice."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from lexjax import sharding as shard_lib

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    batch = NamedSharding(mesh, PartitionSpec("data", None))
    views = [_ProcessView(batch, i, processes) for i in range(processes)]
    rows = [shard_lib.process_rows(view, batch_size) for view in views]
    assert rows == [(i, processes) for i in range(processes)]
    make = lambda index, count: data.make_train_iterator(
        _documents(40), seq_len=SEQ_LEN, batch_size=batch_size, seed=3,
        shard_index=index, shard_count=count,
    )  # fmt: skip
    (whole,) = _take(make(0, 1), 1)
    parts = [_take(make(*r), 1)[0] for r in rows]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    replicated = NamedSharding(mesh, PartitionSpec(None, None))  # every process holds all
    assert shard_lib.process_rows(_ProcessView(replicated, 1, 2), batch_size) == (0, 1)


@pytest.mark.slow
def test_shards_split_one_global_stream_with_worker_processes():
    """The same with 2 grain workers per shard: the stream depends on worker_count,
    not on the shard count."""
    shards = [*_shards(1, worker_count=2), *_shards(2, worker_count=2)]
    try:
        global_batches = _take(shards[0], 3)
        _assert_rows_of(shards[1:], global_batches)
        assert len({_state(it) for it in shards}) == 1
    finally:
        for it in shards:
            it.close()


@pytest.mark.parametrize("taken", [0, 1, 3, 7])
def test_resume_equals_uninterrupted(taken):
    make = lambda: data.make_train_iterator(_documents(), seq_len=SEQ_LEN, batch_size=3, seed=5)
    iterator = make()
    _take(iterator, taken)
    state = json.loads(json.dumps(iterator.get_state()))  # Checkpoints store it as JSON.
    uninterrupted = _take(iterator, 5)
    resumed = make()
    resumed.set_state(state)
    _assert_batches_equal(_take(resumed, 5), uninterrupted)


def test_epochs_are_reshuffled_and_finite():
    documents = _documents(30)
    batches = list(
        data.make_train_iterator(documents, seq_len=SEQ_LEN, batch_size=1, seed=2, num_epochs=2)
    )
    segments = [
        (tuple(inputs), tuple(targets)) for b in batches for inputs, targets, _ in _segments(b)
    ]
    once = _chunks(documents)
    assert collections.Counter(segments) == once + once
    half = sum(once.values())
    assert segments[:half] != segments[half:]


def test_bad_pipeline_arguments():
    with pytest.raises(DataError, match="shard_index"):
        data.make_train_iterator(
            _documents(), seq_len=8, batch_size=2, seed=0, shard_index=2, shard_count=2
        )
    with pytest.raises(DataError, match="cannot be split evenly over 2 shards"):
        data.make_train_iterator(
            _documents(), seq_len=8, batch_size=3, seed=0, shard_index=1, shard_count=2
        )
    with pytest.raises(DataError, match="no documents"):
        data.make_train_iterator([], seq_len=8, batch_size=2, seed=0)
    with pytest.raises(DataError, match="open_documents must be >= 1"):
        data.make_train_iterator(_documents(), seq_len=8, batch_size=2, seed=0, open_documents=0)


def test_pipeline_reads_a_prepared_dataset(corpus):
    source = data.load_source("textfiles", "train", corpus["data_dir"], corpus["pattern"])
    it = data.make_train_iterator(source, seq_len=SEQ_LEN, batch_size=2, seed=0, shuffle_rows=0)
    batch = next(it)
    assert batch["inputs"].shape == (2, SEQ_LEN)
    assert batch["inputs"][0, 0] == data.BOS
    assert "tensorflow" not in sys.modules


def test_eval_documents():
    documents = ["", "ab", "abcdef", "abcdefgh"]
    all_documents = list(data.eval_documents(documents))
    assert [len(d) for d in all_documents] == [2, 4, 8, 10]
    np.testing.assert_array_equal(all_documents[1], data.encode_document("ab"))
    long_ones = list(data.eval_documents(documents, max_docs=1, min_len=8))
    assert len(long_ones) == 1 and data.decode(long_ones[0]) == "abcdef"


@pytest.mark.slow
def test_worker_processes_resume_exactly():
    make = lambda: data.make_train_iterator(
        _documents(), seq_len=SEQ_LEN, batch_size=2, seed=4, worker_count=2
    )
    iterator = make()
    _take(iterator, 3)
    state = iterator.get_state()
    uninterrupted = _take(iterator, 3)
    iterator.close()
    resumed = make()
    resumed.set_state(state)
    try:
        _assert_batches_equal(_take(resumed, 3), uninterrupted)
    finally:
        resumed.close()


# ---------------------------------------------------------------- the split rule


def _book(path, lines, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "whale", "ship", "sea", "Ahab", "said", "und", "café", "naïve", ","]
    text = "".join(
        " ".join(rng.choice(words, size=int(rng.integers(3, 15)))) + "\n" for _ in range(lines)
    )
    path.write_text(text, encoding="utf-8")
    return text.encode()


def _split_bytes(plan):
    """{split: {relpath: [(start, end), ...]}} of a plan."""
    out = {s: collections.defaultdict(list) for s in data.SPLITS}
    for split, pieces in plan.pieces.items():
        for p in pieces:
            out[split][p.relpath].append((p.start, p.end))
    return out


@pytest.mark.parametrize("count", [1, 3])
def test_few_files_split_within_each_file_and_no_byte_is_in_two_splits(tmp_path, count):
    books = {f"book{i}.txt": _book(tmp_path / f"book{i}.txt", 400, seed=i) for i in range(count)}
    plan = data.plan_corpus("textfiles", str(tmp_path / "*.txt"))
    assert plan.rule == "within files"
    assert plan == data.plan_corpus("textfiles", str(tmp_path / "*.txt"))  # deterministic
    ranges = _split_bytes(plan)
    for name, content in books.items():
        (t0, t1), (v0, v1), (s0, s1) = (ranges[s][name][0] for s in data.SPLITS)
        # Contiguous, disjoint, covering: train | validation | test, in that order.
        assert (t0, t1, v1, s1) == (0, v0, s0, len(content))
        assert 0.89 < t1 / len(content) < 0.92 and 0.94 < v1 / len(content) < 0.97
        assert content[v0 - 1 : v0] == b"\n" and content[s0 - 1 : s0] == b"\n"  # line starts
    # What the build stores is exactly those bytes.
    data_dir = tmp_path / "tfds"
    stored = collections.defaultdict(dict)
    for split in data.SPLITS:
        source = data.load_source("textfiles", split, data_dir, str(tmp_path / "*.txt"))
        for i in range(len(source)):
            stored[split][source._records[i]["path"].decode()] = source[i]
    for name, content in books.items():
        assert b"".join(stored[s][name] for s in data.SPLITS) == content


def test_a_cut_inside_a_long_run_of_invalid_utf8_leaves_no_byte_in_two_splits(tmp_path):
    """The 90% cut found no character start within its window and snapped to the end
    of the file, past the 95% cut: train took the whole file and test its tail too."""
    content = bytearray(b"line of text\n" * 120_000)  # 1,560,000 bytes
    content[1_400_000:1_480_000] = b"\x80" * 80_000  # around the 90% cut, before the 95%
    (tmp_path / "book.txt").write_bytes(bytes(content))
    plan = data.plan_corpus("textfiles", str(tmp_path / "*.txt"))
    assert plan.rule == "within files"
    (t0, t1), (v0, v1), (s0, s1) = (_split_bytes(plan)[s]["book.txt"][0] for s in data.SPLITS)
    assert (t0, t1, v1, s1) == (0, v0, s0, len(content))  # contiguous, no byte twice
    assert t1 == int(0.9 * len(content)) and content[s0 - 1 : s0] == b"\n"


def test_two_file_names_that_read_alike_are_both_built(tmp_path):
    """A Latin-1 name is stored with its undecodable byte as '\\xe9'; a name with those
    four characters gave the same TFDS key, and the build ended in a traceback."""
    corpus = os.fsencode(tmp_path / "corpus")
    os.mkdir(corpus)
    texts = {b"caf\xe9.txt": b"first file's text\n" * 200, b"caf\\xe9.txt": b"other text\n" * 200}
    for name, text in texts.items():
        with open(os.path.join(corpus, name), "wb") as f:
            f.write(text)
    files = str(tmp_path / "corpus" / "*.txt")
    stored = b"".join(
        source[i]
        for split in data.SPLITS
        for source in [data.load_source("textfiles", split, tmp_path / "tfds", files)]
        for i in range(len(source))
    )
    assert sorted(stored.splitlines(keepends=True)) == sorted(
        b"".join(texts.values()).splitlines(keepends=True)
    )


def test_many_files_split_by_file_hash(tmp_path):
    names = [f"f{i:03d}.txt" for i in range(300)]
    for i, name in enumerate(names):
        (tmp_path / name).write_text(f"file {i}\n")
    plan = data.plan_corpus("textfiles", str(tmp_path / "*.txt"))
    assert plan.rule == "by file"
    ranges = _split_bytes(plan)
    for name in names:
        homes = [s for s in data.SPLITS if name in ranges[s]]
        assert homes == [builders.split_of(name)]
        assert ranges[homes[0]][name] == [(0, len(f"file {names.index(name)}\n"))]


def test_explicit_validation_and_test_files_override(tmp_path):
    for i, name in enumerate(("a", "b", "val", "test")):
        _book(tmp_path / f"{name}.txt", 50, seed=i)  # other text: a copy would not train
    plan = data.plan_corpus(
        "textfiles",
        str(tmp_path / "*.txt"),
        validation_files=str(tmp_path / "val.txt"),
        test_files=str(tmp_path / "test.txt"),
    )
    ranges = _split_bytes(plan)
    assert sorted(ranges["train"]) == ["a.txt", "b.txt"]  # whole files, not split inside
    assert [len(r) for r in ranges["train"].values()] == [1, 1]
    assert list(ranges["validation"]) == ["val.txt"] and list(ranges["test"]) == ["test.txt"]
    # Only a validation glob: the test split comes from the tails of the rest.
    plan = data.plan_corpus(
        "textfiles", str(tmp_path / "*.txt"), validation_files=str(tmp_path / "val.txt")
    )
    ranges = _split_bytes(plan)
    assert list(ranges["validation"]) == ["val.txt"]
    assert sorted(ranges["test"]) == ["a.txt", "b.txt", "test.txt"]
    assert "val.txt" not in ranges["train"]


def test_one_book_whose_bucket_is_held_out_still_trains_with_validation_files(tmp_path):
    """A pool file whose path hashes to test, with data.validation_files: every
    automatic held-out split had a file, so the whole book went to test and nothing
    was left to train on ("too small to hold out train text; … pass data.train_files",
    a setting that does not exist). It is split within the file instead."""
    name = next(
        f"notes{i}.txt" for i in range(1000) if builders.split_of(f"notes{i}.txt") == "test"
    )
    (tmp_path / "pool").mkdir()
    book = _book(tmp_path / "pool" / name, 400)
    _book(tmp_path / "held.txt", 50)
    plan = data.plan_corpus(
        "textfiles", str(tmp_path / "pool" / "*.txt"), validation_files=str(tmp_path / "held.txt")
    )
    assert plan.rule == "within files"
    ranges = _split_bytes(plan)
    (t0, t1), (s0, s1) = ranges["train"][name][0], ranges["test"][name][0]
    assert (t0, t1, s1) == (0, s0, len(book)) and 0.9 < t1 / len(book) < 0.97
    assert list(ranges["validation"]) == ["held.txt"]


def test_a_copy_of_a_held_out_file_in_the_pool_is_not_trained_on(tmp_path):
    """ "f4 (1).txt", a byte-identical copy of the validation file, was trained on: 183
    training segments were validation text. Links were told apart, copies were not."""
    for name in ("a", "b", "c"):
        _book(tmp_path / f"{name}.txt", 50, seed=ord(name))
    (tmp_path / "va").mkdir()
    held = _book(tmp_path / "va" / "f4.txt", 50, seed=4)
    (tmp_path / "f4 (1).txt").write_bytes(held)
    plan = data.plan_corpus(
        "textfiles", str(tmp_path / "*.txt"), validation_files=str(tmp_path / "va" / "*.txt")
    )
    ranges = _split_bytes(plan)
    assert "f4 (1).txt" not in ranges["train"] and "f4 (1).txt" not in ranges["test"]
    assert sorted(ranges["train"]) == ["a.txt", "b.txt", "c.txt"]
    assert plan.skipped["copies of held-out files"] == 1 and plan.num_files == 4


def test_a_misspelt_dataset_name_gets_a_did_you_mean(tmp_path):
    """data.name=textfile with files said only "… apply to ('python_stdlib',
    'textfiles') only, not 'textfile'"; an unknown name advised `tfds build` of it."""
    _book(tmp_path / "a.txt", 5)
    with pytest.raises(DataError, match=r"not 'textfile' \(did you mean data.name=textfiles\?\)$"):
        data.load_source("textfile", "train", tmp_path / "tfds", str(tmp_path / "*.txt"))
    with pytest.raises(
        DataError, match=r"^dataset 'pg91' is not .* \(did you mean data.name=pg19\?\); run"
    ):
        data.load_source("pg91", "train", tmp_path / "tfds")
    with pytest.raises(
        DataError, match=r"^dataset 'pg19' is not prepared in \S+; run `tfds build pg19"
    ):
        data.load_source("pg19", "train", tmp_path / "tfds")  # a real name: no guess


def test_copies_whose_paths_hash_to_two_splits_keep_their_text_in_one(tmp_path):
    """Under the by-file rule two byte-identical files whose paths hash to train and
    validation put the same text in both splits."""
    names = [f"f{i:03d}.txt" for i in range(300)]
    for i, name in enumerate(names):
        (tmp_path / name).write_text(f"file {i}\n")
    home = {
        s: next(n for n in (f"copy{i}.txt" for i in range(999)) if builders.split_of(n) == s)
        for s in data.SPLITS
    }
    for name in home.values():
        (tmp_path / name).write_text("the same text in three places\n")
    plan = data.plan_corpus("textfiles", str(tmp_path / "*.txt"))
    assert plan.rule == "by file"
    ranges = _split_bytes(plan)
    assert [s for s in data.SPLITS if set(home.values()) & set(ranges[s])] == ["test"]
    assert plan.skipped["copies of held-out files"] == 2
    # Where leaving the copies out would empty a split, the files are split inside
    # instead (it refused: "the corpus is too small to hold out validation text").
    small = tmp_path / "small"
    small.mkdir()
    for split, text in (("test", "same text\n"), ("validation", "same text\n")):
        (small / home[split]).write_text(text)
    for i in range(2):
        name = next(
            f"t{i}_{j}.txt" for j in range(999) if builders.split_of(f"t{i}_{j}.txt") == "train"
        )
        (small / name).write_text(f"train text {i}\n" * 20)
    plan = data.plan_corpus("textfiles", str(small / "*.txt"))
    assert plan.rule == "within files" and all(plan.pieces[s] for s in data.SPLITS)


def test_validation_and_test_files_selecting_the_same_files_are_refused(tmp_path):
    """Their text would be in both held-out splits (it was, and counted twice)."""
    for i, name in enumerate(("a", "b", "held1", "held2")):
        _book(tmp_path / f"{name}.txt", 50, seed=i)  # other texts: copies are refused too
    with pytest.raises(DataError) as e:
        data.plan_corpus(
            "textfiles",
            str(tmp_path / "*.txt"),
            validation_files=str(tmp_path / "held*.txt"),
            test_files=str(tmp_path / "h*2.txt"),
        )
    assert str(e.value) == (
        "data.validation_files and data.test_files both select 1 file (first "
        f"{tmp_path / 'held2.txt'}), whose text would be in both splits; make the two "
        "globs select different files"
    )
    # A copy, not the same file, is refused alike (it was in both held-out splits), and
    # said to be one (it said "both select", of globs selecting different files).
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "held2 copy.txt").write_bytes((tmp_path / "held2.txt").read_bytes())
    with pytest.raises(DataError) as e:
        data.plan_corpus(
            "textfiles",
            str(tmp_path / "*.txt"),
            validation_files=str(tmp_path / "val" / "*.txt"),
            test_files=str(tmp_path / "held2.txt"),
        )
    assert str(e.value) == (
        "data.validation_files selects 1 file with the text of a data.test_files file (first "
        f"{tmp_path / 'val' / 'held2 copy.txt'}, a copy), which would be in both splits; "
        "select files of other text"
    )


def test_held_out_globs_that_take_every_file_say_so(tmp_path):
    """Nothing left to train on because data.validation_files took every file: the
    error names that flag (it blamed empty or binary files, of which there were none)."""
    for name in ("held1", "held2"):
        _book(tmp_path / f"{name}.txt", 50)
    with pytest.raises(DataError) as e:
        data.plan_corpus(
            "textfiles", str(tmp_path / "*.txt"), validation_files=str(tmp_path / "held*.txt")
        )
    assert str(e.value) == (
        "no training text: data.validation_files selects every file data.files does (2); "
        "make it select fewer"
    )


def test_symlinks_and_hard_links_are_the_file_they_name(tmp_path):
    """A symlink to a file, a symlinked directory, a symlink loop under ** and a hard
    link put no file's bytes in two splits and count each file once (each path used to
    be a file of its own, with its own path hash: the same text in train and in test;
    hard links were, until they were told apart by device and inode)."""
    real = tmp_path / "real"
    real.mkdir()
    for i in range(40):
        (real / f"doc{i}.txt").write_text(f"document {i}\n" * 3)
    (real / "copy.txt").symlink_to(real / "doc0.txt")
    os.link(real / "doc1.txt", real / "hard.txt")
    (tmp_path / "alias").symlink_to(real)
    (real / "loop").symlink_to(real)
    plan = data.plan_corpus("textfiles", str(tmp_path / "**" / "*.txt"))
    assert plan.num_files == 40
    homes = collections.defaultdict(list)
    for split, pieces in plan.pieces.items():
        for piece in pieces:
            homes[os.stat(piece.path).st_ino].append(split)
            assert re.fullmatch(r"real/doc\d+\.txt", piece.relpath)  # the path with no symlink
    assert len(homes) == 40 and all(len(splits) == 1 for splits in homes.values())


def test_two_symlink_loops_under_globstar_are_one_line_not_a_hang(tmp_path, monkeypatch):
    """Each loop repeats the tree under it; two multiply the paths without end (2^40:
    train.py printed nothing for as long as it ran). One loop still plans its files."""
    monkeypatch.setattr(builders, "_LOOP_CHECK_AFTER", 2000)  # the real bound: 100,000
    corpus = tmp_path / "corpus"
    for name in ("a", "b"):
        (corpus / name).mkdir(parents=True)
        (corpus / name / "x.txt").write_text(f"text of {name}\n" * 20)
    (corpus / "a" / "loop").symlink_to(corpus)
    assert builders.glob_files(str(corpus / "**"))[1] != []  # one loop: ~40 paths a file
    (corpus / "b" / "loop").symlink_to(corpus)
    with pytest.raises(DataError) as e:
        builders.glob_files(str(corpus / "**"))
    assert re.fullmatch(
        rf"data.files='{re.escape(str(corpus))}/\*\*' reaches the same files over and over "
        r"through symlink loops \(\d+ paths to \d+ files and directories, and counting\); "
        "remove the loops or narrow the glob",
        str(e.value),
    )
    # Hard links are files of their own names, not a loop (an rsnapshot tree).
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "0.txt").write_text("one file\n")
    for i in range(1, 2100):
        os.link(linked / "0.txt", linked / f"{i}.txt")
    assert len(builders.glob_files(str(linked / "*.txt"))[1]) == 2100


def test_long_files_become_bounded_documents_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "_MAX_DOCUMENT_BYTES", 1000)
    content = _book(tmp_path / "big.txt", 2000)
    content += "é".encode() * 3000  # a long last line: cut between characters, never inside one
    (tmp_path / "big.txt").write_bytes(content)
    plan = data.plan_corpus("textfiles", str(tmp_path / "*.txt"))
    pieces = [builders.documents(p) for s in data.SPLITS for p in plan.pieces[s]]
    chunks = [chunk for piece in pieces for _, chunk in piece]
    assert b"".join(chunks) == content
    assert max(map(len, chunks)) <= 1000
    for chunk in chunks:
        chunk.decode("utf-8")  # each document is whole characters
        # Cut at line starts: a document holding a line break ends with one (none
        # begins with the newline of the line before it).
        assert b"\n" not in chunk or chunk.endswith(b"\n")


@pytest.mark.parametrize("content", [b"\xc3" + b"\x80" * 2500, b"\x80" * 2500])
def test_a_window_without_a_character_start_still_advances(tmp_path, monkeypatch, content):
    """No line break and no UTF-8 character start in a document's window (a lead byte
    and then only continuation bytes): the cut was 0 and the build hung forever, or
    1 byte and every document re-read the window."""
    monkeypatch.setattr(builders, "_MAX_DOCUMENT_BYTES", 1000)
    (tmp_path / "a.txt").write_bytes(content)
    chunks = [
        chunk
        for _, chunk in itertools.islice(
            builders.documents(builders.Piece(str(tmp_path), "a.txt", 0, len(content))), 10
        )
    ]
    assert b"".join(chunks) == content
    assert len(chunks) == 3


def test_a_file_that_shrinks_while_read_is_a_one_line_error(tmp_path):
    """A file cut shorter after its size was taken stopped a build or an evaluation
    with "IndexError: index out of range"."""
    (tmp_path / "a.txt").write_bytes(b"line\n" * 10)
    with pytest.raises(
        DataError, match="a.txt changed while it was read .*ends at byte 50, not 80"
    ):
        list(builders.documents(builders.Piece(str(tmp_path), "a.txt", 0, 80)))


def test_empty_binary_and_invalid_files_are_counted(tmp_path, capfd):
    _book(tmp_path / "good.txt", 200)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (tmp_path / "latin1.txt").write_bytes("ça va\n".encode("latin-1") * 40)
    source = data.load_source("textfiles", "train", tmp_path / "tfds", str(tmp_path / "*.txt"))
    out = capfd.readouterr().out
    assert "(2 files, split within files; skipped 1 empty, 1 binary)" in out
    assert "; 1 file had invalid UTF-8, replaced by U+FFFD" in out
    texts = [source[i] for i in range(len(source))]
    assert any("\ufffd".encode() in t for t in texts)


@pytest.mark.parametrize(
    "files,message",
    [
        ({"a.txt": b"", "b.txt": b""}, "no training text: the files are 2 empty and 0 binary"),
        ({"a.bin": b"\0\1\2"}, "no training text: the files are 0 empty and 1 binary"),
        # Both missing splits at once (one, then the other, each run after following
        # the advice).
        ({"a.txt": b"ab"}, "too small to hold out validation text (1 text files); add text or"),
        (
            {"a.txt": b"x\n" * 3},  # cut at line ends: neither held-out split gets a line
            "too small to hold out validation and test text (1 text files); add text or "
            "pass data.validation_files and data.test_files",
        ),
    ],
)
def test_corpora_without_text_are_one_line_errors(tmp_path, files, message):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=re.escape(message)) as e:
        data.load_source("textfiles", "train", tmp_path / "tfds", str(tmp_path / "*"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "tfds" / "textfiles").exists() or not any(
        (tmp_path / "tfds" / "textfiles").iterdir()
    )


# ---------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def sentencepiece_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("books")
    for i in range(3):
        _book(root / f"book{i}.txt", 600, seed=i)
    data_dir = tmp_path_factory.mktemp("tfds")
    pattern = str(root / "*.txt")
    tok = data.load_tokenizer("sentencepiece", 300, "textfiles", data_dir, pattern)
    return {"tokenizer": tok, "data_dir": data_dir, "pattern": pattern}


@pytest.mark.parametrize(
    "text", ["", "the whale said", "naïve café\n\n  indented\tline", "日本語 𝄞 ✓", "a\0b"]
)
def test_sentencepiece_round_trips_any_text_and_counts_its_bytes(sentencepiece_corpus, text):
    tok = sentencepiece_corpus["tokenizer"]
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.decode(ids) == text
    document = tok.encode_document(text)
    assert (document[0], document[-1]) == (tok.bos, tok.eos)
    assert tok.decode(document) == text
    assert tok.num_bytes(document) == len(text.encode("utf-8"))
    # Bytes are read as UTF-8, an invalid byte as U+FFFD (as a build reads a file).
    raw = text.encode("utf-8") + b"\xff" + text.encode("utf-8")
    assert tok.decode(tok.encode(raw)) == f"{text}\ufffd{text}"


def test_sentencepiece_learned_without_spaces_still_round_trips_a_space():
    # Text with no space among its characters (Japanese, with ideographic spaces)
    # gives a model without a "▁" piece; a space in other text (eval_files, a prompt)
    # came back as "▁" from 3 byte ids and counted 3 bytes in bits per byte.
    rng = np.random.default_rng(0)
    kana = [chr(c) for c in range(0x3041, 0x3097)] + list("、。")
    lines = ["\u3000" + "".join(rng.choice(kana, size=60)) for _ in range(2000)]
    tok = tokenizer_lib.train_sentencepiece(lines, 400)
    for text in ["Tokyo 2024 です", "  two  spaces ", " ", "あい う"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.num_bytes(ids) == len(text.encode("utf-8"))
    space = tok.encode("あい う")[len(tok.encode("あい"))]  # one id: the byte 0x20
    assert tok.utf8([space]) == b" "


def test_the_tokenizer_sample_takes_long_lines_in_pieces_within_each_budget():
    """A line longer than the trainer takes (4096 characters) is sampled whole, in
    consecutive pieces, up to the document's share of the budget; short lines are
    sampled as they are. (It kept a line's first 4096 characters: a corpus of
    one-line files gave the trainer 4 KiB each.)"""
    long, short = "ab" * 5000, "short line"  # 10,000 characters
    pieces = list(tokenizer_lib.sample_lines([long, f"{short}\n\n{short}"], budget=40_000))
    assert [len(p) for p in pieces] == [4096, 4096, 1808, len(short), len(short)]
    assert "".join(pieces[:3]) == long
    # A budget of 5,000 a document: the piece that reaches it is the last one taken.
    assert [len(p) for p in tokenizer_lib.sample_lines([long, short], 10_000)] == [4096, 4096, 10]
    # A budget reached exactly stops there: lines of 4 bytes and a newline, 10 bytes
    # a document, are two lines (5 + 5 = 10), not three.
    assert list(tokenizer_lib.sample_lines(["abcd\n" * 4], 10)) == ["abcd", "abcd"]
    # The budget counts bytes (it counted characters: 3× the bytes of CJK text).
    cjk = "\n".join(["東京" * 100] * 10)  # lines of 200 characters, 600 bytes
    assert [len(p) for p in tokenizer_lib.sample_lines([cjk], 1_000)] == [200, 200]


_LEARN_UNTIL_SIGTERM = (
    _STOP_ON_SIGTERM
    + """
import subprocess
import numpy as np
from lexjax.data import tokenizer
learners = []
class Recorded(subprocess.Popen):  # the learning process, to say how it ended
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        learners.append(self)
subprocess.Popen = Recorded
rng = np.random.default_rng(0)
letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
words = np.array(["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 10, 20000)])
lines = [" ".join(row) for row in words[rng.integers(0, len(words), (40000, 30))].tolist()]
print("learning", flush=True)  # 7 MiB, 8,000 ids: 9 s and more on 2 cores
try:
    tokenizer.train_sentencepiece(lines, 8000)
except Stopped:
    print("stopped; the learner's status", learners[0].returncode, flush=True)
"""
)


def _with_in_environ(marker: str) -> list[str]:
    """The pids of the processes whose environment holds ``marker`` (``NAME=value``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if marker.encode() in f.read().split(b"\0"):
                found.append(pid)
    return found


def test_sigterm_stops_sentencepiece_while_it_learns(tmp_path):
    """The learning was one call into SentencePiece's C++ code, where no signal
    handler runs: a SIGTERM or Ctrl-C waited for it to end. It now
    learns in a child process, killed when the parent stops."""
    marker = f"LEXJAX_TEST_LEARNER={tmp_path.name}"
    env = dict(os.environ, LEXJAX_TEST_LEARNER=tmp_path.name)
    proc = subprocess.Popen(
        [sys.executable, "-c", _LEARN_UNTIL_SIGTERM], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline() == "learning\n"
    time.sleep(1.0)  # into the learning
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # Killed mid-learning (-9), not stopped after it had learned (0).
    assert (out, proc.returncode) == ("stopped; the learner's status -9\n", 0)

    assert _with_in_environ(marker) == []  # killed, not left to learn on


# A parent in a process group of its own that only records signals (as a multi-process
# run does until its processes agree) and gets one sent to its whole group, the
# learner too (a shell's SIGHUP to its jobs when the ssh session drops, Slurm's SIGTERM).
_LEARN_THROUGH_A_GROUP_SIGNAL = """
import os, signal, sys, threading, time
from lexjax.data import tokenizer
os.setpgrp()
sig, got = getattr(signal, sys.argv[1]), []
signal.signal(sig, lambda s, f: got.append(s))
lines = [f"line {i} of words " * 20 for i in range(20000)]

def later():
    time.sleep(1.0)  # into the learning
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        print("learner", bool(f.read().split()), flush=True)  # (it runs: the test tests)
    os.killpg(0, sig)

threading.Thread(target=later, daemon=True).start()
tokenizer.train_sentencepiece(lines, 300)
print("learned", got == [sig], flush=True)
"""


@pytest.mark.parametrize("name", ["SIGHUP", "SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_group_leaves_the_learning_to_the_parent(name):
    """The learner ignored SIGTERM and Ctrl-C but not SIGHUP: a dropped ssh session
    killed it, and the run failed ('the learning process was killed by SIGHUP')."""
    done = subprocess.run(
        [sys.executable, "-c", _LEARN_THROUGH_A_GROUP_SIGNAL, name],
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = (done.returncode, done.stdout)
    assert said == (0, "learner True\nlearned True\n"), done.stderr[-2000:]


def test_the_learner_dies_with_a_parent_that_a_signal_ends(tmp_path):
    """A script calling lexjax.data directly keeps SIGHUP's default action: the hangup
    ended it, and the learner, which ignores the signal, learned on for no one."""
    marker = f"LEXJAX_TEST_LEARNER={tmp_path.name}"
    env = dict(os.environ, LEXJAX_TEST_LEARNER=tmp_path.name)
    script = _LEARN_THROUGH_A_GROUP_SIGNAL.replace(
        "signal.signal(sig, lambda s, f: got.append(s))",
        "signal.signal(sig, signal.SIG_DFL)  # it dies (a suite under nohup ignores SIGHUP)",
    ).replace("range(20000)", "range(100000)")  # learning for long after the signal
    done = subprocess.run(
        [sys.executable, "-c", script, "SIGHUP"], env=env, capture_output=True, timeout=240
    )
    assert (done.returncode, done.stdout) == (-signal.SIGHUP, b"learner True\n"), done.stderr

    deadline = time.monotonic() + 3  # (a learner left alive learns on for many seconds)
    while _with_in_environ(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _with_in_environ(marker) == []


def test_sentencepiece_learns_with_the_parents_path_and_needs_a_runnable_python(
    tmp_path, monkeypatch
):
    """The learner is a fresh interpreter: it did not see a notebook's sys.path
    additions (sentencepiece found there was "No module named 'sentencepiece'"), and an
    embedded interpreter's empty sys.executable was a PermissionError traceback."""
    (tmp_path / "sentencepiece.py").write_text("raise ImportError('the parent path comes first')")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(DataError, match="the parent path comes first"):
        tokenizer_lib.train_sentencepiece(["some text"], 300)
    monkeypatch.setattr(sys, "executable", "")
    with pytest.raises(DataError, match="^sentencepiece training needs a Python to run it in"):
        tokenizer_lib.train_sentencepiece(["some text"], 300)


def test_a_train_split_of_blank_lines_gives_sentencepiece_nothing_and_says_so():
    """It was SentencePiece's "INTERNAL: src/trainer_interface.cc(467)
    [!sentences_.empty()]"; the byte tokenizer trains on such a corpus."""
    lines = tokenizer_lib.sample_lines([b"\n" * 1000, b"", b"\n\n"])
    with pytest.raises(DataError, match="^sentencepiece has nothing to learn from: the train"):
        tokenizer_lib.train_sentencepiece(lines, 261)


def test_byte_tokenizer_counts_bytes_and_round_trips_through_json():
    tok = data.BYTES
    # Hand count: BOS + "é!" (2 + 1 bytes) + EOS cover 3 bytes.
    assert tok.num_bytes([data.BOS, 0xC3, 0xA9, 0x21, data.EOS]) == 3
    assert tokenizer_lib.from_json(tok.to_json()) is tok
    assert tok.vocab_size == 258


def test_sentencepiece_is_stored_with_the_build_and_reused(sentencepiece_corpus, capfd):
    tok = sentencepiece_corpus["tokenizer"]
    assert tok.vocab_size == 300
    [model] = glob.glob(
        str(sentencepiece_corpus["data_dir"] / "textfiles" / "*" / "*" / "sentencepiece-300.model")
    )
    again = data.load_tokenizer(
        "sentencepiece",
        300,
        "textfiles",
        sentencepiece_corpus["data_dir"],
        sentencepiece_corpus["pattern"],
    )
    assert capfd.readouterr().out == ""  # neither built nor trained again
    assert again.fingerprint == tok.fingerprint
    # A model learned from another feature's text is another model, not this one.
    other = dict(text_feature="path", train=False)
    args = ("sentencepiece", 300, "textfiles", sentencepiece_corpus["data_dir"])
    assert data.load_tokenizer(*args, sentencepiece_corpus["pattern"], **other) is None
    restored = tokenizer_lib.from_json(json.loads(json.dumps(tok.to_json())))
    assert restored.fingerprint == tok.fingerprint
    # A record of another shape, or bytes that are no model, from a run made elsewhere:
    # AttributeError, TypeError or SentencePiece's RuntimeError (a traceback, exit 1).
    junk = base64.b64encode(b"no model at all").decode()
    for record, said in (
        ([1, 2], "is a list, not a dict"),
        ({"kind": "sentencepiece", "model": 5}, "unreadable"),
        ({"kind": "sentencepiece", "model": "@@"}, "unreadable"),
        ({"kind": "sentencepiece", "model": junk}, "does not match its checksum"),
        ({"kind": "sentencepiece", "model": "", "sha256": hashlib.sha256().hexdigest()}, "empty"),
        (
            {
                "kind": "sentencepiece",
                "model": junk,
                "sha256": hashlib.sha256(b"no model at all").hexdigest(),
            },
            "does not parse",
        ),
    ):
        with pytest.raises(DataError, match=said):
            tokenizer_lib.from_json(record)
    import pickle

    assert (
        pickle.loads(pickle.dumps(tok)).encode("the sea").tolist() == tok.encode("the sea").tolist()
    )


def test_sentencepiece_feeds_the_packing_pipeline(sentencepiece_corpus):
    tok = sentencepiece_corpus["tokenizer"]
    source = data.load_source(
        "textfiles", "train", sentencepiece_corpus["data_dir"], sentencepiece_corpus["pattern"]
    )
    batch = next(
        data.make_train_iterator(
            source, seq_len=SEQ_LEN, batch_size=2, seed=0, tokenizer=tok, shuffle_rows=0
        )
    )
    assert batch["inputs"][0, 0] == tok.bos
    assert batch["inputs"].max() < tok.vocab_size
    document = next(data.eval_documents(source, tokenizer=tok))
    np.testing.assert_array_equal(document, tok.encode_document(source[0]))


def test_vocab_larger_than_the_corpus_supports_names_the_largest(tmp_path):
    (tmp_path / "a.txt").write_text("abc abd\n" * 200)
    with pytest.raises(
        DataError, match=r"data\.vocab_size=5000 is more than this corpus supports; use at most \d+"
    ):
        data.load_tokenizer(
            "sentencepiece", 5000, "textfiles", tmp_path / "tfds", str(tmp_path / "*.txt")
        )
    assert not glob.glob(str(tmp_path / "tfds" / "textfiles" / "*" / "*" / "sentencepiece-*"))


def test_held_out_files_without_text_are_named(tmp_path):
    """Said "the corpus is too small to hold out validation text; … pass
    data.validation_files", to a run that had passed it."""
    from tests.processes import write_corpus

    files = write_corpus(tmp_path / "corpus")
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "empty.txt").write_text("")
    (tmp_path / "held" / "binary.txt").write_bytes(b"\0\1\2")
    with pytest.raises(DataError) as e:
        data.plan_corpus("textfiles", files, validation_files=str(tmp_path / "held" / "*"))
    assert str(e.value) == (
        "data.validation_files selects no text: its 2 files are empty or binary; make it "
        "select text files"
    )


@pytest.mark.parametrize("corpus", [None, "textfiles/abc"], ids=["unrecorded", "recorded"])
def test_evaluation_of_a_run_whose_corpus_files_moved_says_so(tmp_path, corpus):
    """eval.py advised `files='…'`, a setting it has no flag for, when the files a run
    trained on had moved (the build found from them first, or read)."""
    from lexjax import evaluation
    from tests.helpers import small_config

    files = str(tmp_path / "moved" / "*.txt")
    config = small_config(
        **{"data.name": "textfiles", "data.files": files, "data.data_dir": str(tmp_path / "tfds")}
    )
    with pytest.raises(DataError) as e, errors.naming_flags():  # as eval.py names its flags
        evaluation.held_out_documents(config, corpus=corpus)
    assert str(e.value) == (
        f"data.files={files!r}, the files this run trained on, matches no files now; put them "
        "back at that path (a symlink to where they are now will do), or evaluate on held-out "
        "text of your own with --eval_files"
    )


def test_evaluation_stops_at_a_damaged_test_split_instead_of_scoring_another(tmp_path):
    """Only a split the dataset lacks falls back to the next one (with a note); a
    damaged test split is the one-line damage error, not the validation split's scores."""
    from lexjax import evaluation
    from tests.helpers import small_config
    from tests.processes import write_corpus

    files = write_corpus(tmp_path / "corpus")
    config = small_config(
        **{"data.name": "textfiles", "data.files": files, "data.data_dir": str(tmp_path / "tfds")}
    )
    notes = []
    where, _ = evaluation.held_out_documents(config, say=notes.append)
    assert where == "textfiles test split" and not notes
    (test_file,) = glob.glob(str(tmp_path / "tfds" / "textfiles" / "*" / "*" / "*-test.*"))
    with open(test_file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="is damaged; delete it and run again"):
        evaluation.held_out_documents(config, say=notes.append)
    assert not notes


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_build_file_cut_in_half_is_damage_not_a_traceback(tmp_path, split):
    """An ArrayRecord file cut short past its first records (a copy of a data_dir that
    stopped midway) reads its records as empty ones, whose text is None: a TypeError
    traceback, exit 1, where a file cut to 100 bytes is the one-line damage error."""
    from tests.processes import write_corpus

    files = write_corpus(tmp_path / "corpus")
    data_dir = tmp_path / "tfds"
    data.load_source("textfiles", split, data_dir, files)
    (records,) = data_dir.glob(f"textfiles/*/*/textfiles-{split}.array_record-*")
    os.truncate(records, records.stat().st_size // 2)
    with pytest.raises(DataError, match="is damaged; delete it and run again") as e:
        data.load_source("textfiles", split, data_dir, files)
    assert f"{records.parent} is damaged" in str(e.value) and "\n" not in str(e.value)
    shutil.rmtree(records.parent)  # as the line says: the next use builds it again
    assert len(data.load_source("textfiles", split, data_dir, files)) > 0


def test_a_build_without_its_dataset_info_is_damage_not_an_empty_build(tmp_path, capfd):
    """TFDS takes the directory of a build without dataset_info.json as built: the build
    line said "done" having written nothing, then no split could be read ("`splits` is
    empty"; exit 3 with no advice, and eval.py fell back to the validation split)."""
    from tests.processes import write_corpus

    files = write_corpus(tmp_path / "corpus")
    data_dir = tmp_path / "tfds"
    data.load_source("textfiles", "train", data_dir, files)
    (info,) = data_dir.glob("textfiles/*/*/dataset_info.json")
    info.unlink()
    capfd.readouterr()
    for split in ("train", "test"):
        with pytest.raises(DataError) as e:
            data.load_source("textfiles", split, data_dir, files)
        assert str(e.value).startswith(f"the corpus build {info.parent} is damaged")
        assert str(e.value).endswith("(it has no dataset_info.json)")
    assert "building" not in capfd.readouterr().out
    shutil.rmtree(info.parent)  # as the line says: the next use builds it again
    assert len(data.load_source("textfiles", "test", data_dir, files)) > 0


def _as_other_dataset(build_dir, root, version: str) -> None:
    """A copy of the textfiles build at ``build_dir`` as version ``version`` of the TFDS
    dataset ``mycorp/cfg`` under ``root`` (a dataset lexjax reads, not one it builds)."""
    target = root / "mycorp" / "cfg" / version
    shutil.copytree(build_dir, target)
    for path in target.glob("textfiles-*"):
        path.rename(target / path.name.replace("textfiles", "mycorp"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(name="mycorp", version=version, configName="cfg")
    (target / "dataset_info.json").write_text(json.dumps(info))


def test_another_datasets_tokenizer_is_stored_with_the_version_it_was_learned_from(tmp_path):
    """Of two prepared versions, TFDS reads the newest (10.0.0), and the tokenizer learned
    from it was stored in the last dataset_info.json's directory in path order (2.0.0's):
    a run on version 2.0.0 then took that tokenizer, learned from other text, as its own."""
    built = {}
    for version, letters in (("2.0.0", "abcdefghij"), ("10.0.0", "KLMNOPQRST")):
        corpus = tmp_path / f"corpus-{version}"
        corpus.mkdir()
        rng = np.random.default_rng(0)
        for i in range(3):
            words = ["".join(rng.choice(list(letters), size=4)) for _ in range(4000)]
            lines = [" ".join(words[j : j + 10]) for j in range(0, len(words), 10)]
            (corpus / f"{i}.txt").write_text("\n".join(lines) + "\n")
        built[version] = data.prepare("textfiles", tmp_path / "tfds", str(corpus / "*")).data_dir
    other = tmp_path / "other"
    for version, build_dir in built.items():
        _as_other_dataset(build_dir, other, version)
    newest = data.load_tokenizer("sentencepiece", 300, "mycorp/cfg", other)
    assert (other / "mycorp/cfg/10.0.0/sentencepiece-300.model").exists()
    assert not (other / "mycorp/cfg/2.0.0/sentencepiece-300.model").exists()
    older = data.load_tokenizer("sentencepiece", 300, "mycorp/cfg:2.0.0", other)
    assert older.fingerprint != newest.fingerprint
    assert "K" in newest.decode(newest.encode("KLMN")) and "a" in older.decode(older.encode("ab"))

"""grain pipelines: packed, shuffled, sharded training batches and evaluation documents.

Packing convention (the model and its tests rely on it). Each document is
d = [BOS, tokens..., EOS] (bytes unless a `tokenizer` is given); its training
pair is inputs = d[:-1], targets = d[1:]. The pair is cut into chunks of at
most `seq_len` tokens, and chunks are packed first-fit into rows of exactly
`seq_len`. A batch is a dict of int32 numpy arrays, each [rows, seq_len]
(rows: this process's share of the global batch_size):

- `inputs`, `targets`: token ids; 0 at padding;
- `segment_ids`: 1, 2, 3, ... for the chunks of a row, 0 at padding;
- `positions`: 0, 1, 2, ... restarting at every chunk, 0 at padding.

Within a segment targets[t] == inputs[t + 1]. A long document continues in
another row as a new segment whose positions start at 0 again, so attention
never crosses a row boundary and the model never sees positions >= seq_len.

One global stream for any number of processes. Every process builds the same
pipeline over the whole source: shuffle, tokenize, chunk, pack into global
batches of `batch_size` rows, and keeps its own rows of each (shard i of n:
rows [i*b, (i+1)*b), b = batch_size / n; training gives each process the
rows its devices hold, `lexjax.sharding.process_rows`). The global batches,
their order and the iterator's state are therefore the same for any process
count, equal on every process, and a state saved by n processes restores on
m: an elastic resume neither repeats nor skips a document. (They do depend
on the source's documents, `seq_len`, `batch_size`, `seed`, `shuffle_rows`,
`open_documents` and `worker_count`: a state saved under other ones means another position,
and training refuses to resume from it, `lexjax.training._stream_settings`.)
The price is that every
process reads, tokenizes and packs every document, n times the host work of
a pipeline that shards documents by process; per process it is the work of
a one-process run, and `worker_count` moves it to worker processes.

Two steps mix the stream. Chunks are taken in turn from `open_documents`
documents read at once, so a long document's chunks are spread over the
stream (one in `open_documents` while other documents remain to take turns;
a document's share of the rows is still its share of the tokens) instead of
following one another: without it a book-length file, longer than the shuffle window below,
filled whole windows by itself and its batches held its rows only. Then packed
rows pass through a shuffle window of `shuffle_rows` rows before they are
batched: in packing order most batches of a small batch size held rows of a
few neighbouring documents (measured on the standard library at batch 16), a
poorly mixed gradient. Host memory: the open documents and one window of rows.

Data order changes, for the record (`STREAM_VERSION`): per-process document
shards (process i read documents i, i + n, ... and packed its own rows) gave
way to the global stream, then packing order to the row shuffle, then one
document's chunks after another to chunks in turn from open documents. A
checkpoint whose iterator state belongs to an older stream restarts the
stream from its beginning with a one-line note (`lexjax.checkpoint`).
"""

import signal
from collections.abc import Iterator, Sequence

import grain
import numpy as np
from absl import flags

from lexjax.data import tokenizer as tokenizer_lib
from lexjax.errors import DataError

# Rows of the shuffle window between packing and batching (make_train_iterator).
SHUFFLE_ROWS = 1024
# Documents whose chunks are taken in turn before packing (make_train_iterator).
OPEN_DOCUMENTS = 16
# Bumped when the stream for the same source, seed and settings changes, so a checkpoint's
# iterator state of another layout restarts the stream instead of failing (lexjax.checkpoint).
# 2: packed rows shuffled in windows of shuffle_rows before batching.
# 3: chunks taken in turn from open_documents documents before packing.
STREAM_VERSION = 3


def as_document(
    document: str | bytes | np.ndarray, tokenizer: tokenizer_lib.Tokenizer = tokenizer_lib.BYTES
) -> np.ndarray:
    """Returns int32 ids [BOS, tokens..., EOS]; raw text is encoded, ids pass through."""
    if isinstance(document, (str, bytes)):
        return tokenizer.encode_document(document)
    return np.asarray(document, dtype=np.int32)


# Transforms live at module level so grain worker processes can unpickle them.
class _Tokenize(grain.transforms.Map):
    def __init__(self, tokenizer: tokenizer_lib.Tokenizer):
        self.tokenizer = tokenizer

    def map(self, document):
        return as_document(document, self.tokenizer)


class _InterleavedChunks(grain.IterDataset):
    """{'inputs', 'targets'} chunks of at most seq_len tokens, taken in turn
    from `open_documents` documents of `documents` read at once.

    Documents are opened in order into `open_documents` slots; each turn goes
    to the next slot, which yields its document's next chunk (a finished
    document's slot opens the next document). A document longer than the
    others yields one chunk in `open_documents` while it lasts, so a book's
    rows are spread over the stream instead of filling it by themselves. With
    one slot this is each document's chunks one after another.
    """

    def __init__(self, documents: grain.MapDataset, seq_len: int, open_documents: int):
        super().__init__(documents)  # A parent, so grain's worker processes slice it.
        self.seq_len, self.open_documents = seq_len, open_documents

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's worker processes: worker i of n reads documents i, i + n, ..."""
        if sequential_slice:
            raise NotImplementedError("open documents are sliced by stride, not in runs")
        self._parents = (self._parent.slice(sl),)

    def __iter__(self):
        return _InterleavedChunksIterator(self._parent, self.seq_len, self.open_documents)


class _InterleavedChunksIterator(grain.DatasetIterator):
    """State: the next document to open, the turn, and each slot's
    [document index, offset of its next chunk] (None: empty). Restoring
    re-reads the open documents."""

    def __init__(self, documents: grain.MapDataset, seq_len: int, open_documents: int):
        super().__init__()
        self._documents, self._seq_len = documents, seq_len
        self._next_document, self._turn = 0, 0
        self._slots: list[list[int] | None] = [None] * open_documents
        self._read: list[np.ndarray | None] = [None] * open_documents

    def __next__(self):
        while True:
            more = self._next_document < len(self._documents)
            if not more and all(slot is None for slot in self._slots):
                raise StopIteration
            turn = self._turn
            self._turn = (turn + 1) % len(self._slots)
            if self._slots[turn] is None:
                if not more:
                    continue
                self._slots[turn] = [self._next_document, 0]
                self._read[turn] = self._documents[self._next_document]
                self._next_document += 1
            start, document = self._slots[turn][1], self._read[turn]
            length = len(document) - 1  # (input, target) pairs in the document
            stop = min(start + self._seq_len, length)
            if stop == length:
                self._slots[turn] = self._read[turn] = None
            else:
                self._slots[turn][1] = stop
            if start < length:  # (a document of ids may have no pair at all)
                return {"inputs": document[start:stop], "targets": document[start + 1 : stop + 1]}

    def get_state(self):
        return {
            "next_document": self._next_document,
            "turn": self._turn,
            "slots": [None if slot is None else list(slot) for slot in self._slots],
        }

    def set_state(self, state):
        if len(state["slots"]) != len(self._slots):
            raise DataError(
                f"the saved stream read {len(state['slots'])} documents at once, this one "
                f"{len(self._slots)}"
            )
        self._next_document, self._turn = state["next_document"], state["turn"]
        self._slots = [None if slot is None else list(slot) for slot in state["slots"]]
        self._read = [None if slot is None else self._documents[slot[0]] for slot in self._slots]


class _Rows(grain.transforms.Map):
    """Keeps rows [start, stop) of a global batch."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def map(self, batch):
        return {key: value[self.start : self.stop] for key, value in batch.items()}


class _RenamePacked(grain.transforms.Map):
    """Keeps one copy of grain's per-feature segment ids/positions (they agree)."""

    def map(self, row):
        return {
            "inputs": row["inputs"],
            "targets": row["targets"],
            "segment_ids": row["inputs_segment_ids"],
            "positions": row["inputs_positions"],
        }


def make_train_iterator(
    source: Sequence,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    worker_count: int = 0,
    tokenizer: tokenizer_lib.Tokenizer = tokenizer_lib.BYTES,
    shuffle_rows: int = SHUFFLE_ROWS,
    open_documents: int = OPEN_DOCUMENTS,
) -> grain.DatasetIterator:
    """Returns a checkpointable iterator of this shard's rows of the global
    stream of packed batches (see module docstring).

    Args:
      source: random-access documents (`len` and `[i]`), each raw text (str or
        bytes, e.g. `load_source(...)`) or ids from `encode_document`.
      seq_len: row length.
      batch_size: rows per *global* batch (all shards together); the packing
        and so the stream depend on it, not on `shard_count`.
      seed: seeds the document shuffle (different each epoch) and the order in
        which packed rows leave a packing window; 0 <= seed < 2**32.
      shard_index, shard_count: this iterator yields rows
        [shard_index * b, (shard_index + 1) * b), b = batch_size / shard_count,
        of every global batch (one shard per process: which rows a process
        feeds is `lexjax.sharding.process_rows`). Every shard reads every
        document.
      num_epochs: passes over the source; None repeats forever. A last
        incomplete global batch is dropped.
      worker_count: grain worker processes for background prefetch; 0 runs
        in-process. Batches are deterministic for a given worker_count but
        differ between counts (packing is stateful and runs per worker).
      tokenizer: encodes raw-text documents (default bytes).
      shuffle_rows: packed rows are drawn in random order from consecutive
        windows of this many rows before they are batched (0 or 1: in packing
        order). Packing emits rows in the order chunks come, so without it
        neighbouring rows of a few documents share a batch.
      open_documents: chunks are taken in turn from this many documents read
        at once (1: each document's chunks one after another), so a document
        longer than the shuffle window (a book) still shares its batches. A
        document's share of the rows is its share of the tokens: a book is
        spread while other documents remain to take turns, and a book that is
        most of the corpus still fills most rows (with copies from two passes
        open at once near the end of a pass).

    `it.get_state()` / `it.set_state(state)` resume exactly: a restored
    iterator yields the batches an uninterrupted one would. The state is the
    global stream's position, the same for every shard and shard count (for
    a given worker_count), so it restores onto any shard of any count.
    """
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be >= 1, got {seq_len=} {batch_size=}")
    if not 0 <= shard_index < shard_count:
        raise DataError(f"need 0 <= shard_index < shard_count, got {shard_index=} {shard_count=}")
    if batch_size % shard_count:
        raise DataError(
            f"batch_size={batch_size} rows cannot be split evenly over {shard_count} shards"
        )
    if not 0 <= seed < 2**32:
        raise DataError(f"seed must be in [0, 2**32), got {seed}")
    if num_epochs is not None and num_epochs < 1:
        raise DataError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    if shuffle_rows < 0:
        raise DataError(f"shuffle_rows must be >= 0, got {shuffle_rows}")
    if open_documents < 1:
        raise DataError(f"open_documents must be >= 1, got {open_documents}")
    if len(source) == 0:
        raise DataError("the source has no documents; use a larger split")
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(num_epochs)
    ds = _InterleavedChunks(ds.map(_Tokenize(tokenizer)), seq_len, open_documents)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"inputs": seq_len, "targets": seq_len},
        num_packing_bins=batch_size,
        seed=seed,
        shuffle_bins=True,
    )
    ds = ds.map(_RenamePacked())
    if shuffle_rows > 1:
        # grain seeds window w with seed + w, which its shuffle takes as 32 bits: a seed
        # near 2**32 ended in a TypeError after a few windows. Seeds below 2**31 keep
        # their stream; those above share one with seed - 2**31 (their streams changed).
        window_seed = seed % 2**31
        ds = grain.experimental.WindowShuffleIterDataset(
            ds, window_size=shuffle_rows, seed=window_seed
        )
    ds = ds.batch(batch_size, drop_remainder=True)
    if shard_count > 1:
        rows = batch_size // shard_count
        ds = ds.map(_Rows(shard_index * rows, (shard_index + 1) * rows))
    if worker_count > 0:
        # grain reads its absl flags when starting workers; a notebook or a
        # program without absl.app.run has not parsed them, so use defaults.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=worker_count),
            worker_init_fn=_worker_ignores_ctrl_c,
        )
    return iter(ds)


def _worker_ignores_ctrl_c(worker_index: int, worker_count: int) -> None:
    """Runs first in each grain worker process. A terminal's Ctrl-C reaches the
    whole foreground process group, the workers too; the program that reads
    the batches decides what it means (training stops after its step and then
    closes the iterator, which ends the workers), so a worker leaves it alone
    instead of dying with a KeyboardInterrupt traceback."""
    del worker_index, worker_count
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def eval_documents(
    source: Sequence,
    max_docs: int | None = None,
    min_len: int = 0,
    tokenizer: tokenizer_lib.Tokenizer = tokenizer_lib.BYTES,
) -> Iterator[np.ndarray]:
    """Yields int32 documents [BOS, tokens..., EOS] in source order.

    Documents shorter than `min_len` tokens (BOS and EOS included) are skipped;
    at most `max_docs` documents are yielded.
    """
    yielded = 0
    for index in range(len(source)):
        if max_docs is not None and yielded >= max_docs:
            return
        document = as_document(source[index], tokenizer)
        if len(document) >= min_len:
            yielded += 1
            yield document

"""Data for lexjax: byte tokenizer, TF-less TFDS ArrayRecord datasets, grain pipelines.

source = load_source("python_stdlib", "train")          # raw text, random access
it = make_train_iterator(source, seq_len=256, batch_size=8, seed=0)
batch = next(it)   # inputs, targets, segment_ids, positions: int32 [8, 256]
"""

from lexjax.data.builders import (
    BUILDER_NAMES,
    DEFAULT_DATA_DIR,
    SPLITS,
    PythonStdlib,
    TextFiles,
    TextSource,
    load_source,
    prepare,
    split_of,
)
from lexjax.data.pipeline import as_document, eval_documents, make_train_iterator
from lexjax.data.tokenizer import BOS, EOS, VOCAB_SIZE, decode, encode, encode_document

__all__ = [
    "BOS",
    "BUILDER_NAMES",
    "DEFAULT_DATA_DIR",
    "EOS",
    "SPLITS",
    "VOCAB_SIZE",
    "PythonStdlib",
    "TextFiles",
    "TextSource",
    "as_document",
    "decode",
    "encode",
    "encode_document",
    "eval_documents",
    "load_source",
    "make_train_iterator",
    "prepare",
    "split_of",
]

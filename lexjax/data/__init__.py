"""Data for lexjax: tokenizers, TF-less TFDS ArrayRecord datasets, grain pipelines.

source = load_source("python_stdlib", "train")          # raw text, random access
tok = load_tokenizer("sentencepiece", 2048, "python_stdlib")   # or "bytes"
it = make_train_iterator(source, seq_len=256, batch_size=8, seed=0, tokenizer=tok)
batch = next(it)   # inputs, targets, segment_ids, positions: int32 [8, 256]
"""

from lexjax.data.builders import (
    BUILDER_NAMES,
    DEFAULT_DATA_DIR,
    SPLITS,
    MissingSplit,
    NoFiles,
    PythonStdlib,
    TextFiles,
    TextSource,
    build_name,
    check_data_dir_path,
    check_outside,
    load_source,
    load_tokenizer,
    plan_corpus,
    planned_build,
    prepare,
    resolve_data_dir,
    split_of,
)
from lexjax.data.pipeline import as_document, eval_documents, make_train_iterator
from lexjax.data.tokenizer import (
    BOS,
    BYTES,
    EOS,
    VOCAB_SIZE,
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    decode,
    encode,
    encode_document,
)

__all__ = [
    "BOS",
    "BUILDER_NAMES",
    "BYTES",
    "DEFAULT_DATA_DIR",
    "EOS",
    "SPLITS",
    "MissingSplit",
    "NoFiles",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "PythonStdlib",
    "SentencePieceTokenizer",
    "TextFiles",
    "TextSource",
    "build_name",
    "planned_build",
    "Tokenizer",
    "as_document",
    "check_outside",
    "decode",
    "encode",
    "encode_document",
    "eval_documents",
    "load_source",
    "load_tokenizer",
    "make_train_iterator",
    "plan_corpus",
    "prepare",
    "resolve_data_dir",
    "check_data_dir_path",
    "split_of",
]

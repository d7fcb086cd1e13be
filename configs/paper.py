"""The paper's setting (Sun et al. 2022, §4.1) for accelerators.

24 layers, d_model 1024, 16 heads, training length 1024 subword tokens, batch
512 × 1024 tokens, Adam β = (0.9, 0.98), ε = 1e-6 (the defaults), learning rate
3e-4 with polynomial decay, bfloat16 compute. Tokens are SentencePiece pieces
(32768 ids) learned from the training split when the dataset is built, so
lengths are in subword tokens as in the paper, not bytes.

What may differ from the paper: the data (the paper's pre-training corpus is
not bundled; pass yours as below), the tokenizer (the paper does not name
one; here a SentencePiece model learned from your corpus), and how long it
trains (50k steps here; the paper states neither its step count nor its token
count). On a TPU pod
slice or a GPU host (``-1`` fills the fsdp axis with every device):

    python train.py --config=configs/paper.py --workdir=gs://BUCKET/lex-paper \
        --config.data.name=scientific_papers/arxiv --config.data.text_feature=article

Position variants for the paper's comparison: ``--config.model.position=``
``xpos`` (LEX), ``rope``, ``alibi``, ``sinusoidal``.
"""

from lexjax import config

# What differs from lexjax/config.py's defaults; a plain dict, so bench/ can read it
# on accelerator hosts without ml_collections.
OVERRIDES = {
    "model": dict(
        num_layers=24,
        d_model=1024,
        num_heads=16,
        mlp_dim=4096,
        dtype="bfloat16",
        remat_policy="full",
        scan_layers=True,
        attention_impl="fused",
    ),
    "data": dict(tokenizer="sentencepiece", vocab_size=32768),
    "optim": dict(schedule="polynomial", end_lr_fraction=0.0),
    "mesh": dict(data=1, fsdp=-1),
    "sharding": "fsdp",
    "learning_rate": 3e-4,
    "warmup_steps": 375,
    "train_len": 1024,
    "batch_size": 512,
    "num_train_steps": 50_000,
    "checkpoint_every": 1000,
    "eval_every": 1000,
    "log_every": 50,
}


def get_config():
    return config.default_configdict(OVERRIDES)

"""The paper's setting (Sun et al. 2022, §4.1) for accelerators.

24 layers, d_model 1024, 16 heads, training length 1024, batch 512 × 1024
tokens, Adam β = (0.9, 0.98), ε = 1e-6, learning rate 3e-4 with polynomial
decay, bfloat16 compute. On a TPU pod slice or a GPU host (``-1`` fills the
data axis with every device; use sharding=fsdp for large meshes):

    python train.py --config=configs/paper.py --workdir=gs://BUCKET/lex-paper \
        --config.data.name=scientific_papers/arxiv --config.data.text_feature=article

Position variants for the paper's comparison: ``--config.model.position=``
``xpos`` (LEX), ``rope``, ``alibi``, ``sinusoidal``.
"""

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.model.update(
        dict(
            num_layers=24,
            d_model=1024,
            num_heads=16,
            mlp_dim=4096,
            max_len=1024,
            scale_base=512.0,
            dtype="bfloat16",
            remat=True,
            scan_layers=True,
            attention_impl="fused",
        )
    )
    c.learning_rate = 3e-4
    c.warmup_steps = 375
    c.optim.update(
        dict(
            schedule="polynomial", end_lr_fraction=0.0, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01
        )
    )
    c.sharding = "fsdp"
    c.mesh.update(dict(data=1, fsdp=-1, tensor=1))
    c.train_len = 1024
    c.batch_size = 512
    c.num_train_steps = 50_000
    c.checkpoint_every = 1000
    c.eval_every = 1000
    c.log_every = 50
    return c

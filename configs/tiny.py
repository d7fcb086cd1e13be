"""The CPU default: a ~4.8 M-parameter byte-level LEX model, training length 256.

Trains to a clearly falling loss in about 5 minutes on 2 CPU cores:

    python train.py --config=configs/tiny.py --workdir=runs/tiny
    python eval.py --workdir=runs/tiny

Any field can be overridden, e.g. ``--config.model.position=rope``.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.model = config_dict.ConfigDict(
        dict(
            position="xpos",  # xpos | rope | alibi | sinusoidal | learned | none
            num_layers=6,
            d_model=256,
            num_heads=4,
            mlp_dim=1024,
            vocab_size=320,  # 258 byte-level tokens, padded so the vocabulary shards evenly
            scale_base=512.0,  # XPOS b; must be the same in training and inference
            theta=10000.0,
            max_len=256,
            tie_embeddings=True,
            dtype="float32",  # compute dtype; bfloat16 on accelerators
            param_dtype="float32",
            remat=False,
            scan_layers=False,
            attention_impl="explicit",  # explicit | fused (jax.nn.dot_product_attention; cuDNN on GPUs)
        )
    )
    c.data = config_dict.ConfigDict(
        dict(
            name="python_stdlib",  # python_stdlib | textfiles | any TFDS dataset in ArrayRecord form
            files=config_dict.placeholder(str),
            data_dir=config_dict.placeholder(str),
            text_feature="text",
            worker_count=0,
        )
    )
    c.optim = config_dict.ConfigDict(
        dict(
            schedule="cosine",
            end_lr_fraction=0.1,
            b1=0.9,
            b2=0.98,
            eps=1e-6,
            weight_decay=0.01,
            grad_clip=1.0,
            grad_accum_steps=1,
        )
    )
    c.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.sharding = "tensor"  # logical-axis preset: data | fsdp | tensor
    c.train_len = 256
    c.batch_size = 16
    c.num_train_steps = 200
    c.learning_rate = 2e-3  # peak, after a linear warmup
    c.warmup_steps = 20
    c.checkpoint_every = 100
    c.keep_checkpoints = 3
    c.eval_every = 100
    c.eval_batches = 4
    c.log_every = 10
    c.seed = 0
    c.on_corrupt_checkpoint = "fallback"
    c.poison_step = -1
    return c

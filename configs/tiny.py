"""The CPU default: a ~4.8 M-parameter byte-level LEX model, training length 256.

Trains to a clearly falling loss in minutes on 2 CPU cores:

    python train.py --config=configs/tiny.py --workdir=runs/tiny
    python eval.py --workdir=runs/tiny

Its values are the defaults of lexjax/config.py, which lists every field. Any
field can be overridden, e.g. ``--config.model.position=rope``.
"""

from lexjax import config


def get_config():
    return config.default_configdict()

"""Stub of timm's stochastic depth, as torchscale's DropPath calls it."""


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    if scale_by_keep:
        mask.div_(keep)
    return x * mask

"""The optimizer and its learning-rate schedule, both pure functions of the config."""

from __future__ import annotations

import jax
import optax

from lexjax.config import Config

__all__ = ["decayed", "learning_rate_schedule", "make_optimizer"]

_NOT_DECAYED = ("bias", "scale")  # every Dense/LayerNorm bias and LayerNorm scale


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """Linear warmup to the peak, then cosine / polynomial decay or constant.

    The warmup rises from 0 at step 0 (so the first update changes no parameter;
    its gradient still enters Adam's moments) to the peak at ``warmup_steps``, as
    optax's and most JAX trainers' warmups do. The decay reaches ``peak ·
    end_lr_fraction`` at step ``num_train_steps``, one past the last update
    (``constant`` stays at the peak; with ``num_train_steps ≤ warmup_steps`` the
    peak itself is never reached).
    The schedule is a function of the step count only, so it depends on
    ``num_train_steps``: a resumed run with another total follows the new curve.
    """
    o = config.optim
    peak, steps, warm = config.learning_rate, config.num_train_steps, config.warmup_steps
    decay_steps = max(steps - warm, 1)
    if o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=o.end_lr_fraction)
    elif o.schedule == "polynomial":
        end = peak * o.end_lr_fraction
        decay = optax.polynomial_schedule(peak, end, power=1.0, transition_steps=decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def decayed(params):
    """The weight-decay mask: True for kernels and embeddings, False for biases
    and LayerNorm scales. Chosen by name, so that scanned layers (which stack
    every parameter on a leading layer axis) decay the same ones."""

    def leaf(path, _):
        return getattr(path[-1], "key", None) not in _NOT_DECAYED

    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW; no weight decay on biases and LayerNorm
    scales (:func:`decayed`)."""
    o = config.optim
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
        optax.adamw(
            learning_rate_schedule(config),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=decayed,
        ),
    )

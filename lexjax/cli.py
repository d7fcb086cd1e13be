"""The boundary between the command-line programs and the library.

Errors a user can cause are reported as one line on stderr with a non-zero
exit status (2 for configuration errors), never as a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

from lexjax.config import ConfigError, from_configdict

__all__ = ["run_training", "fail"]


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class _NoOrbaxErrors(logging.Filter):
    """Drops orbax's ERROR logs (tracebacks from its background write threads).

    The same failure reaches the Checkpointer as an exception at the next save or
    wait, and the user sees it once, as one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def run_training(configdict, workdir: str, cluster=None) -> int:
    """Trains from a config; ``cluster`` (a ``distributed.ClusterOptions``) joins a
    multi-process run first. Only process 0 prints the summary."""
    from lexjax import distributed
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoOrbaxErrors())
    try:
        config = from_configdict(configdict)
        distributed.initialize(cluster or distributed.ClusterOptions())
    except ConfigError as e:
        fail(str(e), 2)
    except distributed.DistributedError as e:
        fail(str(e))
    import jax
    from lexjax import checkpoint, training
    try:
        summary = training.train(config, workdir)
    except ConfigError as e:
        fail(str(e), 2)
    except (training.TrainingError, checkpoint.CheckpointError, ValueError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if jax.process_index() != 0:
        return 0
    if summary["start_step"] == summary["step"] and summary.get("stopped_by") is None:
        print(f"already trained {summary['step']} steps; checkpoint: {summary['checkpoint_dir']}")
    elif summary.get("stopped_by") is None:
        print(f"trained {summary['step']} steps: loss {summary.get('loss', float('nan')):.4f}, "
              f"validation loss {summary.get('val_loss', float('nan')):.4f}")
        print(f"checkpoint: {summary['checkpoint_dir']} (step {summary['step']})")
        print(f"next: python eval.py --workdir={workdir}")
    return 0

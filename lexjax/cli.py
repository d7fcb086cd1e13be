"""The boundary between the command-line programs and the library.

Errors a user can cause are reported as one line on stderr with a non-zero
exit status (2 for configuration errors), never as a traceback.
"""

from __future__ import annotations

import sys

from lexjax.config import ConfigError, from_configdict

__all__ = ["run_training", "fail"]


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_training(configdict, workdir: str) -> int:
    try:
        config = from_configdict(configdict)
    except ConfigError as e:
        fail(str(e), 2)
    from lexjax import checkpoint, training
    try:
        summary = training.train(config, workdir)
    except ConfigError as e:
        fail(str(e), 2)
    except (training.TrainingError, checkpoint.CheckpointError, ValueError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if summary.get("stopped_by") is None:
        print(f"trained {summary['step']} steps: loss {summary.get('loss', float('nan')):.4f}, "
              f"validation loss {summary.get('val_loss', float('nan')):.4f}")
        print(f"checkpoint: {summary['checkpoint_dir']} (step {summary['step']})")
        print(f"next: python eval.py --workdir={workdir}")
    return 0

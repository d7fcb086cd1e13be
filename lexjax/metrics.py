"""What training measures and where it writes it: FLOPs per token, peak FLOP/s, MFU, metrics."""

from __future__ import annotations

import json
import logging
import math
import os
import sys

from lexjax.config import Config
from lexjax.errors import CheckpointError

__all__ = ["PEAK_FLOPS", "flops_per_token", "peak_flops", "mfu", "MetricsWriter", "read_metrics"]

log = logging.getLogger(__name__)

# Datasheet dense bf16 FLOP/s per device, by a lower-cased piece of
# ``jax.Device.device_kind``; the first match wins ("tpu v5 lite" is v5e,
# "tpu v5" v5p).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),  # SXM
    ("a100", 312e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5", 459e12),
    ("tpu v6 lite", 918e12),
    ("tpu v6e", 918e12),
)


def flops_per_token(config: Config) -> float:
    """Analytic training FLOPs per token: 6·(matmul params) + causal attention (counted half).

    Forward+backward = 3× forward; forward = 2 FLOPs per multiply-add. The
    attention scores and weighted sum cost ``2·2·T·D`` per token per layer
    forward, halved because causal attention needs only the lower triangle.
    """
    m = config.model
    per_layer = 4 * m.d_model * m.d_model + 2 * m.d_model * m.mlp_dim
    matmul_params = m.num_layers * per_layer + m.vocab_size * m.d_model
    attention = m.num_layers * 2 * config.train_len * m.d_model
    return 6.0 * matmul_params + 3.0 * attention


def peak_flops(device_kind: str, override: float | None = None) -> float | None:
    """Per-device peak FLOP/s for MFU: ``override`` if given, else the datasheet
    figure of a known accelerator, else None (CPUs, unknown chips: MFU is not
    reported rather than guessed)."""
    if override is not None:
        return float(override)
    kind = device_kind.lower()
    return next((flops for name, flops in PEAK_FLOPS if name in kind), None)


def mfu(tokens_per_sec: float, config: Config, peak_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved analytic FLOP/s over the devices' peak."""
    return tokens_per_sec * flops_per_token(config) / (peak_per_device * num_devices)


def _summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without PyTorch where the process has
    not imported it already. tensorboardX imports ``torch`` whenever it is installed (as
    in Colab), only to accept torch tensors, which this writer never passes: 1.5 s and
    180 MB of a JAX training process's memory on a CPU host. Imported here, not at the
    top: the FLOPs and MFU helpers above serve benchmarks on accelerator hosts that have
    only jax, flax and optax."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # meanwhile, `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends ``{"step": s, ...}`` lines to ``workdir/metrics.jsonl`` and the same
    scalars to TensorBoard event files in ``workdir/tensorboard``.

    ``enabled=False`` (every process but 0) makes it write nothing.
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        if enabled and os.path.isfile(self.path) and os.path.getsize(self.path):
            # A writer killed mid-line left a torn record: start on a line of our own.
            try:
                with open(self.path, "rb+") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
            except OSError as e:  # another user's file, a full disk: before any step
                raise CheckpointError(
                    f"cannot write {self.path} ({e.strerror or e}); make it writable or "
                    "free space, then restart (the checkpoints are kept)"
                ) from None
        # Opened at the first record: a run that fails before it leaves no event file
        # (and a workdir it created can be removed as empty).
        self.tb, self._tb_dir = None, os.path.join(workdir, "tensorboard")
        self.failed = False
        self.start_step: int | None = None

    def start_at(self, step: int) -> None:
        """The run goes on from checkpoint ``step``: when it opens, the records and
        events of later steps (written by a run killed after it, or before a damaged
        step it fell back from) are dropped, as the steps are trained again. They
        were kept, so metrics.jsonl and TensorBoard showed those steps twice."""
        self.start_step = step

    def write(self, step: int, values: dict[str, float]) -> None:
        """Raises CheckpointError when the workdir refuses the record (a full disk):
        one line and exit 4, as a checkpoint that cannot be written."""
        if not self.enabled:
            return
        try:
            self._write(step, values)
        except OSError as e:
            self.failed = True
            raise CheckpointError(
                f"writing step {step}'s metrics to {os.path.dirname(self.path)} failed: "
                f"{e.strerror or e}; free space or fix the directory, then restart "
                "(the checkpoints are kept)"
            ) from None

    def open(self) -> None:
        """Starts the TensorBoard writer (about a second: its import), so that a caller
        can leave that out of what it times; else the first record does it."""
        if self.enabled and self.tb is None:
            SummaryWriter = _summary_writer()
            after = self.start_step
            if after is not None:
                try:
                    self._drop_records_after(after)
                except OSError as e:
                    raise CheckpointError(
                        f"cannot rewrite {self.path} without the steps after {after} "
                        f"({e.strerror or e}); make it writable or free space, then restart "
                        "(the checkpoints are kept)"
                    ) from None
            try:
                # purge_step: TensorBoard hides the earlier events of later steps.
                self.tb = SummaryWriter(
                    self._tb_dir, purge_step=None if after is None else after + 1
                )
            except OSError as e:
                raise CheckpointError(
                    f"cannot write TensorBoard events in {self._tb_dir} ({e.strerror or e}); "
                    "free space or fix the directory"
                ) from None

    def settle_at(self, step: int) -> None:
        """A run that resumes at checkpoint ``step`` with nothing left to train
        ("already trained") writes no record, so the records and events of later steps
        a killed run left are dropped here (they are of steps no checkpoint holds, and
        ``Run.metrics()`` and TensorBoard showed them as the run's last). Only where
        there are any: an untouched file and no new event file otherwise."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            later = any(_record_step(line) > step for line in f if line.strip())
        if later:
            self.start_at(step)
            self.open()

    def _drop_records_after(self, step: int) -> None:
        """Rewrites metrics.jsonl (atomically) without the records of steps after
        ``step`` and torn lines, if it has any."""
        if not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.strip()]
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) < len(lines):
            temporary = f"{self.path}.tmp-{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(temporary, self.path)

    def _write(self, step: int, values: dict[str, float]) -> None:
        self.open()
        # Opened per write: a line is on disk before the next step, whatever stops the run.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        for key, value in values.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def close(self) -> None:
        """After a failed write the events left unwritten are dropped: the error said so."""
        if self.tb is None:
            return
        try:
            self.tb.close()
        except OSError as e:
            if not self.failed:
                raise CheckpointError(
                    f"writing the TensorBoard events to {self._tb_dir} failed: "
                    f"{e.strerror or e}; free space or fix the directory"
                ) from None


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a torn one (dropped with later steps)."""
    try:
        return float(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return math.inf


def read_metrics(workdir: str) -> list[dict[str, float]]:
    """The records of ``workdir/metrics.jsonl`` in the order they were written.
    A line that is not JSON (a record torn when its writer was killed) is
    skipped, with one note; a workdir without the file (copied without it) gives
    none, with a note."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        log.warning("note: %s has no metrics.jsonl (copied without it?): no records", workdir)
        return []
    records, torn = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in filter(str.strip, f):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                torn += 1
    if torn:
        log.warning("note: skipped %d torn line(s) of %s (a writer killed mid-record)", torn, path)
    return records

"""Training: the optimizer, the jitted step, metrics, checkpoints, run directories and the loop.

A step is a pure function ``(params, opt_state, batch, index) -> (params, opt_state, metrics)``;
the loop around it is the only place with I/O. One module a concern, none importing the loop:

- ``config``: ``TrainConfig``, the learning-rate schedule, the optimizer
- ``batch``: what a batch holds, the (seed, step) batches, their rows placed on a mesh
- ``step``: ``make_train_step``, ``make_eval``
- ``checkpoints``: the orbax manager, saves with bit sums, ``SaveFailed``, ``NonFiniteLoss``
- ``restore``: verified restores, ``load_run`` / ``load_model``
- ``run_dir``: the run dir's lock and the rules for a previous run
- ``resume``: what a resume may change, and the schedule a longer resume keeps
- ``preemption``: stopping on SIGTERM or Ctrl-C with a checkpoint at the step reached, ``Preempted``
- ``metrics``: the metrics log (JSON lines, TensorBoard, W&B, terminal), the loss plot, the matmul peak
- ``verify``: the placements proven on the compiled step before it runs
- ``hlo``: reading a lowered program's text (the host transfers it asks for), ``verify``'s and the planner's
- ``profile`` / ``trace_files`` / ``trace_report``: ``train(profile=...)``'s trace of some steps, its files, its per-step report
- ``loop``: ``train``
- ``setup`` (with ``run_data`` and ``export``): a run set up from ``recipes/train.py``'s flags (model,
  mesh, data, checks, ``--save-hf``), its names in ``zoo.train.setup`` only

Every name is importable from ``zoo.train`` itself (``from zoo import train; train.TrainConfig``).
"""

from zoo.train import hlo, profile, resume, setup, trace_report, verify  # noqa: E402,F401  (zoo.train.profile etc., as the docs name them)
from zoo.train.batch import BATCH_FIELDS, as_batch, batches, local_rows, place_batch
from zoo.train.checkpoints import NonFiniteLoss
from zoo.train.config import TrainConfig, learning_rate, optimizer, param_specs
from zoo.train.loop import train
from zoo.train.metrics import (
    MetricsLog,
    TensorBoardWriter,
    WandbWriter,
    device_memory_in_use,
    matmul_peak_flops,
    plot_losses,
)
from zoo.train.preemption import Interrupted, Preempted
from zoo.train.restore import is_run_dir, load_model, load_run
from zoo.train.run_dir import RunDirError, check_run_dir
from zoo.train.step import loss_and_metrics, make_eval, make_train_step

__all__ = [
    "BATCH_FIELDS", "Interrupted", "MetricsLog", "NonFiniteLoss", "Preempted", "RunDirError", "TensorBoardWriter", "TrainConfig", "WandbWriter",
    "as_batch", "batches", "check_run_dir", "device_memory_in_use", "is_run_dir", "learning_rate", "load_model",
    "load_run", "local_rows", "loss_and_metrics", "make_eval", "make_train_step", "matmul_peak_flops", "optimizer",
    "param_specs", "place_batch", "plot_losses", "train",
]  # fmt: skip

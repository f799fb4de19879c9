"""Recording a profile of some training steps: ``train(profile=(START, STOP))`` traces steps
START..STOP-1 (numbered as in metrics.jsonl, the first step is 1) with ``jax.profiler`` into
``RUN_DIR/profile``: the XPlane trace TensorBoard / XProf read, a Perfetto trace, the compiled
step's HLO text and memory figures (``step.hlo.txt``, ``step.json``) for the report
(``recipes/profile.py``), and a device memory profile (``memory.prof``, pprof) of the buffers
live after the first profiled step. Each profiled step is waited for inside its
``train_step`` annotation, so its device work falls in its window.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from zoo.errors import ConfigError
from zoo.runtime import describe_xla_options, step_xla_options
from zoo.train.step import make_train_step
from zoo.train.verify import check_step

PROFILE_DIR = "profile"


def parse_window(text: str) -> tuple[int, int]:
    """``"START:STOP"`` as ``(START, STOP)``; a ``ValueError`` says what is wrong."""
    start, colon, stop = text.partition(":")
    try:
        window = int(start), int(stop)
    except ValueError:
        raise ValueError(f"expected START:STOP (e.g. 3:5, steps 3 and 4), got {text!r}") from None
    if not colon:
        raise ValueError(f"expected START:STOP (e.g. 3:5, steps 3 and 4), got {text!r}")
    return window


def check_window(window: tuple[int, int] | str | None, steps: int, run_dir: str | Path | None) -> tuple[int, int] | None:
    """``window`` as ``(START, STOP)``; a ConfigError for one outside the run's ``steps``, empty, or
    without a run dir to write to."""
    if window is None:
        return None
    if isinstance(window, str):
        try:
            window = parse_window(window)
        except ValueError as e:
            raise ConfigError(f"profile: {e}") from None
    start, stop = window
    if run_dir is None:
        raise ConfigError("profile needs a run dir: the trace goes to RUN_DIR/profile")
    if not 1 <= start < stop <= steps + 1:
        raise ConfigError(f"profile {start}:{stop}: records steps START..STOP-1 of 1..{steps}; need "
                          f"1 <= START < STOP <= {steps + 1}")  # fmt: skip
    return start, stop


class StepProfiler:
    """Starts the trace before step ``start`` and stops it after step ``stop - 1``."""

    def __init__(self, window: tuple[int, int] | None, run_dir: Path | None, **info: Any):
        self.window, self.info = window, info
        self.dir = None if run_dir is None else run_dir / PROFILE_DIR
        self.compiled: Any = None  # the compiled step, for its HLO text and memory figures
        self.tracing, self.first = False, 0

    def active(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is profiled."""
        return self.window is not None and self.window[0] <= step < self.window[1]

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around step ``step`` (1-based): the trace started before the first profiled step, each
        profiled step annotated, the trace stopped after the last."""
        if self.active(step) and not self.tracing:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.tracing, self.first = True, step
        if not self.tracing:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train_step", step_num=step):
            yield
        if step == self.first and jax.process_index() == 0:
            jax.profiler.save_device_memory_profile(str(self.dir / "memory.prof"))
        if step + 1 >= self.window[1]:
            self.stop(step)

    def wait(self, outputs: Any) -> None:
        """Inside a profiled step's annotation: wait for its device work."""
        if self.tracing:
            jax.block_until_ready(outputs)

    def stop(self, last: int) -> None:
        if not self.tracing:
            return
        jax.profiler.stop_trace()
        self.tracing = False
        if jax.process_index() != 0:
            return
        info = {**self.info, "steps": [self.first, last]}
        if self.compiled is not None:
            (self.dir / "step.hlo.txt").write_text(self.compiled.as_text())
            m = self.compiled.memory_analysis()
            if m is not None:
                info["memory"] = {k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}
        (self.dir / "step.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
        print(f"profile of steps {self.first}-{last}: {self.dir} (TensorBoard/XProf: the plugins/ folder; Perfetto: "
              f"perfetto_trace.json.gz); report: python recipes/profile.py {self.dir.parent}", flush=True)  # fmt: skip


class CheckedStep:
    """The run's train step (:func:`zoo.train.step.make_train_step`) compiled with the backend's
    XLA options (printed), its placements proven on the compiled program before the first step
    runs (:func:`zoo.train.verify.check_step`; the steps reuse that compile), and the profiled
    window traced."""

    def __init__(self, model: Any, cfg: Any, tx: Any, *, placement: Any, mesh: Any, param_memory: str,
                 opt_memory: str, xla_options: Any, xla_defaults: bool, profile: Any, run_dir: Path | None):  # fmt: skip
        self.platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        options = step_xla_options(self.platform, xla_options, defaults=xla_defaults)
        if jax.process_index() == 0:
            print(describe_xla_options(self.platform, options), flush=True)
        self.fn = make_train_step(model, cfg, tx, placement=placement, mesh=mesh, param_memory=param_memory,
                                  opt_memory=opt_memory, xla_options=options)  # fmt: skip
        self.profiler = StepProfiler(profile, run_dir, platform=self.platform, xla_options=options,
                                     placement=placement, param_memory=param_memory, opt_memory=opt_memory)  # fmt: skip
        self.check = dict(model=model, placement=placement, param_memory=param_memory, opt_memory=opt_memory)
        self.unchecked = placement is not None or param_memory != "device" or opt_memory != "device" or bool(profile)

    def __call__(self, params: Any, opt_state: Any, batch: Any, step: int) -> Any:
        """Step ``step`` (0-based, a Python int: nothing is read back from the device for it)."""
        index = jnp.int32(step)
        if self.unchecked:
            self.unchecked = False
            self.profiler.compiled = check_step(self.fn, (params, opt_state, batch, index), platform=self.platform,
                                                **self.check)  # fmt: skip
        with self.profiler.step(step + 1):
            out = self.fn(params, opt_state, batch, index)
            self.profiler.wait(out)
        return out

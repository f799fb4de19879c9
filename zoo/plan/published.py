"""Published, measured training runs with their full configuration, and the planner's calibration on them.

Each :class:`Run` is one measured step of a published recipe: model, hardware, device count, the
published mesh mapped to zoo's axes, per-device batch, sequence length, the published remat /
offload policy and the nearest zoo placement map, and the measured tokens per second per device,
with the source of every figure. ``half`` fixes, once and for all, whether a run calibrates the
planner or is held out to test it; :func:`calibrate` fits one matmul efficiency per hardware
(``Hardware.efficiency``, bf16) on the calibration half only, and :func:`predict` prices any run
at a given efficiency (``benchmarks/published_runs.py`` prints the table; ``docs/planning.md``,
"Against published runs", the result).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zoo.core import registry
from zoo.errors import ConfigError
from zoo.placement import resolve
from zoo.plan.mesh_plan import cost_model as plan_cost_model

CALIBRATION, HELD_OUT = "calibration", "held-out"

_RECIPES = "AI-Hypercomputer/tpu-recipes@c8cfe2f689081d36701a101cd73a70965d80926b training/"
_TIERING = "https://maxtext.readthedocs.io/en/latest/reference/models/tiering.html"
_V6E_CONFIGS = "AI-Hypercomputer/maxtext benchmarks/maxtext_trillium_model_configs.py"
_DGXC = "https://catalog.ngc.nvidia.com/orgs/nvidia/teams/dgxc-benchmarking/resources/"
_MBRIDGE = "NVIDIA-NeMo/Megatron-Bridge@067f987 docs/performance-summary-archive.md, 25.11 NeMo container"
_MBRIDGE_FP8 = ("NVIDIA-NeMo/Megatron-Bridge@0a25f911b2ed6c6905a539504fdb8e5b40e3438b docs/performance-summary-archive.md, "
                "25.11 NeMo container, DGX-GB200")

# MaxText's ``custom`` policy offloads the listed tensors and recomputes everything not listed
# (the scanned layer's input stays on device); ``qkv_proj_offloaded`` offloads the q/k/v projections;
# ``save_dot_except_mlpwi`` keeps every weight matmul's output but the MLP's two input projections;
# ``full`` keeps only the layer input. MaxText's ``out_proj`` is zoo's ``attn_out``; MaxText's ``mlpwo``
# (the down projection's output) has no zoo name (zoo never saves it: only the residual add reads it).
OFFLOAD_QKVO = "remat+layer_input=pinned_host,query=pinned_host,key=pinned_host,value=pinned_host,attn_out=pinned_host"
OFFLOAD_QKV_INPUT = "remat+layer_input=pinned_host,query=pinned_host,key=pinned_host,value=pinned_host"
OFFLOAD_QKV = "remat+query=pinned_host,key=pinned_host,value=pinned_host"
SAVE_DOTS_EXCEPT_MLP_IN = "remat+query=device,key=device,value=device,attn_out=device"


@dataclass(frozen=True)
class Run:
    """One published, measured training step and its configuration (per device figures).

    ``mesh``: the published parallelism as a zoo mesh spec (MaxText's ICI and DCN FSDP multiply
    into zoo's one ``fsdp`` axis, whose devices are numbered slice by slice, as MaxText's are;
    Megatron's PP is ``pipeline``, its EP ``expert``). ``per_device_batch``: the global batch over
    the devices (a pipelined run's devices each see its stages times that many rows, one
    micro-batch of MBS 1 each). ``placement``: the zoo map nearest the published ``policy``.
    ``comparable``: False where the run uses what zoo cannot express (a 1F1B pipeline schedule,
    FP8): listed, never predicted or fitted.
    """

    name: str
    model: str  # a zoo preset name, or "llama2-70b"
    hardware: str  # a zoo.hardware name
    devices: int
    mesh: str
    per_device_batch: int  # the global batch over the devices
    seq_len: int
    policy: str  # as published
    placement: str | None  # zoo map spec; None where not comparable
    tokens_per_s: float  # measured, per device
    source: str
    half: str = CALIBRATION
    mfu: float | None = None  # as published (the publisher's FLOP count), where given
    dtype: str = "bfloat16"
    comparable: bool = True
    note: str = ""

    @property
    def batch_size(self) -> int:
        """The global batch: sequences per device times devices."""
        return self.per_device_batch * self.devices


def _v6e_8b(chips: int, pdb: int, tps: float, recipe: str, half: str) -> Run:
    return Run(f"Llama 3.1 8B, v6e-{chips}", "llama3.1-8b", "tpu-v6e", chips, f"fsdp={chips}", pdb, 8192,
               "custom: offload decoder_layer_input, query/key/value_proj, out_proj", OFFLOAD_QKVO, tps,
               _RECIPES + f"trillium/Llama3.1-8B-MaxText/v6e-{chips}/README.md ({recipe})", half)  # fmt: skip


def _v6e_70b(chips: int, pdb: int, tps: float, recipe: str, half: str) -> Run:
    return Run(f"Llama 3.1 70B, v6e-{chips}", "llama3.1-70b", "tpu-v6e", chips, f"fsdp={chips}", pdb, 8192,
               "custom: offload decoder_layer_input, query/key/value_proj", OFFLOAD_QKV_INPUT, tps,
               _RECIPES + f"trillium/Llama3.1-70B-MaxText/v6e-{chips}/README.md ({recipe})", half)  # fmt: skip


RUNS: tuple[Run, ...] = (
    # -- TPU v6e (Trillium), MaxText: the measured step logged in each tpu-recipes README -------------
    _v6e_8b(256, 4, 7207.336, "llama3_1_8b_8192; MaxText tiering: 45.46% MFU, 7,207", CALIBRATION),
    _v6e_8b(128, 4, 7119.648, "llama3_1_8b_8192", HELD_OUT),
    _v6e_8b(64, 5, 7247.111, "llama3_1_8b_8192_bs5", CALIBRATION),
    _v6e_8b(32, 3, 7031.689, "llama3_1_8b_8192_no_collective_matmul", HELD_OUT),
    _v6e_8b(16, 3, 7243.378, "llama3_1_8b_8192_no_collective_matmul", CALIBRATION),
    _v6e_8b(8, 3, 7138.890, "llama3_1_8b_8192_no_collective_matmul", HELD_OUT),
    _v6e_70b(256, 5, 960.248, "llama3_1_70b_8192; MaxText tiering: 50.33% MFU, 960", CALIBRATION),
    _v6e_70b(128, 4, 941.976, "llama3_1_70b_8192_bs4", HELD_OUT),
    _v6e_70b(64, 2, 876.736, "llama3_1_70b_8192_bs2", CALIBRATION),
    _v6e_70b(32, 2, 920.965, "llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul", HELD_OUT),
    Run("Llama 3.1 405B, 2 x v6e-256 (fsdp x tensor)", "llama3.1-405b", "tpu-v6e", 512, "fsdp=128,tensor=4", 1, 8192,
        "custom: offload decoder_layer_input, query/key/value_proj, out_proj", OFFLOAD_QKVO, 123.0,
        f"{_TIERING} (Silver: 38.55% MFU, ~123); config {_V6E_CONFIGS}@5e6a7ca llama3_1_405b_8192_fsdp_dcn "
        "(ici_fsdp 64, ici_tensor 4, dcn_fsdp 2)", CALIBRATION, mfu=0.3855),  # fmt: skip
    Run("Llama 3.1 405B, 2 x v6e-256 (pure fsdp)", "llama3.1-405b", "tpu-v6e", 512, "fsdp=512", 1, 8192,
        "custom: offload decoder_layer_input", "remat+layer_input=pinned_host", 149.482,
        _RECIPES + "trillium/Llama3.1-405B-MaxText/README.md (llama3_1_405b_8192_pure_fsdp_ici: ici_fsdp 256, "
        "dcn_fsdp 2)", HELD_OUT),  # fmt: skip
    Run("Llama 2 70B, v6e-256", "llama2-70b", "tpu-v6e", 256, "fsdp=256", 3, 4096, "qkv_proj_offloaded",
        OFFLOAD_QKV, 905.021, _RECIPES + "trillium/Llama2-70B-MaxText/README.md (llama2_70b_4096_sc; MaxText "
        "tiering: 43.8% MFU, 900)", HELD_OUT, mfu=0.438),  # fmt: skip
    # -- TPU v5p, MaxText ---------------------------------------------------------------------------
    Run("Llama 2 70B, v5p-512", "llama2-70b", "tpu-v5p", 512, "fsdp=512", 4, 4096, "save_dot_except_mlpwi",
        SAVE_DOTS_EXCEPT_MLP_IN, 692.0, f"{_TIERING} (Gold: 65.4% MFU, ~692); config AI-Hypercomputer/maxtext@"
        "92e59fd benchmarks/maxtext_v5p_model_configs.py llama2_70b_v5p_128 (ici_fsdp -1)", CALIBRATION,
        mfu=0.654, note="MaxText also keeps the MLP down projection's output (mlpwo): zoo recomputes it"),  # fmt: skip
    Run("Llama 3.1 405B, v5p-1024", "llama3.1-405b", "tpu-v5p", 1024, "fsdp=1024", 2, 8192,
        "custom: offload context, mlpwo; num_vocab_tiling 4", "remat+context=pinned_host", 124.618,
        _RECIPES + "v5p/Llama3.1-405B-MaxText/README.md; config AI-Hypercomputer/maxtext "
        "benchmarks/maxtext_v5p_model_configs.py llama3_1_405b_8192_v5p_1024", HELD_OUT,
        note="mlpwo (the down projection's output) has no zoo name: zoo recomputes it"),  # fmt: skip
    # -- H100, MaxText (NVIDIA DGX Cloud benchmarking recipes) -----------------------------------------
    Run("Llama 2 70B, 64 H100", "llama2-70b", "h100", 64, "fsdp=64", 2, 4096, "MaxText default (full)", "remat",
        1035.970, _DGXC + "maxtext-llama2-70b-dgxc-benchmarking-c (25.01.1: BF16, FSDP=64, MBS 2, GBS 128)",
        CALIBRATION, mfu=0.4654, note="the recipe page states no remat_policy: MaxText's default, full"),  # fmt: skip
    Run("Llama 3 70B, 128 H100", "llama3.1-70b", "h100", 128, "fsdp=128", 2, 8192, "MaxText default (full)",
        "remat", 1052.266, _DGXC + "maxtext-llama3-70b-dgxc-benchmarking-d (25.02: BF16, GBS 256) with the "
        "parallelism of -g (25.04.01: ici_fsdp 8, dcn_fsdp 16, per_device_batch_size 2)", HELD_OUT,
        note="the recipe page does not state remat_policy: MaxText's default, full; Llama 3 70B is Llama 3.1 "
        "70B's shape"),  # fmt: skip
    # -- Megatron-Bridge, GB200, BF16: interleaved 1F1B pipelines, which zoo runs too; listed only (see the notes)
    Run("DeepSeek-V3, 256 GB200 (PP 4)", "deepseek-v3-671b", "gb200", 256, "pipeline=4,expert=64", 16, 4096,
        "TP 1, PP 4, VP 4, EP 64, GBS 4096, MBS 1", None, 3139.0, _MBRIDGE, comparable=False,
        note="GB200's efficiency is uncalibrated and the recompute policy is not published beside the figure; "
        "priced in docs/planning.md on zoo's interleaved 1F1B (VP 4, chunks of 4, 4, 4, 3)"),  # fmt: skip
    Run("Qwen3 235B-A22B, 256 GB200 (PP 8)", "qwen3-235b-a22b", "gb200", 256, "pipeline=8,expert=32", 32, 4096,
        "TP 1, PP 8, VP 3, EP 32, GBS 8192, MBS 1", None, 4916.0, _MBRIDGE, comparable=False,
        note="GB200's efficiency is uncalibrated and the recompute policy is not published beside the figure; "
        "priced in docs/planning.md on zoo's interleaved 1F1B (VP 3)"),  # fmt: skip
    # -- Megatron-Bridge, GB200, FP8 (issue 40): listed with what keeps each from being predicted
    Run("Llama 3 70B, 64 GB200, FP8-CS", "llama3.1-70b", "gb200", 64, "fsdp=64", 4, 8192,
        "Megatron FSDP, MBS 2, GBS 256, FP8 current scaling, activations of 40 of the 80 layers offloaded to CPU",
        None, 4312.0, _MBRIDGE_FP8 + "; the policy: scripts/performance/configs/llama/llama3_workload_base_configs.py "
        "LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V1 (read in the fork lkk12014402/Megatron-Bridge@67b8806)",
        comparable=False,
        note="offloading every activation of half the layers is no zoo map (a map places each name in every layer)"),
    Run("Llama 3.1 405B, 256 GB200 (PP 16), FP8-CS", "llama3.1-405b", "gb200", 256, "pipeline=16,tensor=4,data=4", 6,
        8192, "TP 4, PP 16, VP 4, GBS 1536, MBS 1, FP8 current scaling", None, 813.0, _MBRIDGE_FP8, comparable=False,
        note="GB200's efficiency is uncalibrated and the recompute policy is not published beside it; "
        "priced in docs/planning.md (1F1B, V = 4)"),  # fmt: skip
    Run("DeepSeek-V3, 256 GB200 (PP 8), FP8-MX", "deepseek-v3-671b", "gb200", 256, "pipeline=8,expert=32", 16, 4096,
        "TP 1, PP 8, VP 4, EP 32, GBS 4096, MBS 1, MXFP8", None, 4018.0, _MBRIDGE_FP8, comparable=False,
        note="GB200's efficiency is uncalibrated and the recompute policy is not published beside it; "
        "priced in docs/planning.md (1F1B, V = 4, MXFP8 as block-scaled FP8 products at the FP8 peak)"),  # fmt: skip
)


def config(run: Run) -> Any:
    """The zoo model config of ``run.model``, through the registry (the planner knows no family)."""
    if run.model == "llama2-70b":
        return registry.by_model_type("llama").config_cls(
            vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
            head_dim=128,
        )  # fmt: skip
    for model_type in ("llama", "deepseek_v3", "qwen3", "qwen3_moe"):
        try:
            return registry.by_model_type(model_type).config_cls.preset(run.model, model_type)
        except ConfigError:
            continue
    raise ConfigError(f"published run {run.name!r}: unknown model {run.model!r}")


def cost_model(run: Run) -> Any:
    """The planner's cost model for ``run``'s model, sequence, mesh and hardware, bf16 compute."""
    if not run.comparable:
        raise ConfigError(f"published run {run.name!r} is not comparable ({run.note}): nothing to predict")
    return plan_cost_model(config(run), seq_len=run.seq_len, mesh=run.mesh, hardware=run.hardware, compute_dtype=run.dtype)


@dataclass(frozen=True)
class Prediction:
    """The planner's figures for one run at one efficiency: tokens/s per device, MFU (zoo's FLOP
    count), step seconds, and whether zoo's memory model fits the run's batch and map."""

    run: Run
    efficiency: float
    tokens_per_s: float
    mfu: float
    step_time: float
    fits: bool

    @property
    def ratio(self) -> float:
        """Predicted over published tokens per second."""
        return self.tokens_per_s / self.run.tokens_per_s


def predict(run: Run, efficiency: float, cm: Any = None) -> Prediction:
    """``run`` priced by the planner with the hardware's matmul efficiency set to ``efficiency``
    (``cm``: its cost model, where already built)."""
    cm = (cm if cm is not None else cost_model(run)).with_efficiency(efficiency)
    placement = resolve(run.placement, cm.base.model)
    b = run.batch_size // cm.shards
    t, flops = cm.time(placement, b, "device", "device")
    device, host = cm.memory(placement, b, "device", "device")
    fits = device <= cm.hw.hbm_bytes and host <= cm.hw.host_bytes
    return Prediction(run, efficiency, run.per_device_batch * run.seq_len / t, flops / (t * cm.peak), t, fits)


GRID = tuple(round(0.2 + 0.005 * i, 3) for i in range(141))  # efficiencies tried: 0.2 to 0.9
TIE = 2e-3  # root-mean-square log ratios this close to the best fit are a tie (0.2% in tokens/s)


def calibrate(runs: Iterable[Run] = RUNS, models: Callable[[Run], Any] | None = None) -> dict[str, float]:
    """One matmul efficiency per hardware, fitted on the calibration half of ``runs`` only: the
    value of :data:`GRID` minimising the squared log ratio of predicted to published tokens/s
    over that hardware's calibration runs (the smallest of those within :data:`TIE` of the
    minimum: a run bound by communication does not tell them apart). ``models``: run -> cost
    model (default :func:`cost_model`)."""
    models = models or cost_model
    by_hw: dict[str, list] = {}
    for run in runs:
        if run.comparable and run.half == CALIBRATION:
            by_hw.setdefault(run.hardware, []).append((run, models(run)))
    fitted = {}
    for hw, pairs in by_hw.items():
        def rms(e: float, pairs: list = pairs) -> float:
            return math.sqrt(sum(math.log(predict(r, e, cm).ratio) ** 2 for r, cm in pairs) / len(pairs))

        errors = {e: rms(e) for e in GRID}
        best = min(errors.values())
        # A run bound by its collectives prices the same at every efficiency above some value: those
        # it cannot tell apart (within TIE of the best fit) are settled for the smallest, not by
        # the last digits of the exposed communication.
        fitted[hw] = min(e for e, err in errors.items() if err <= best + TIE)
    return fitted

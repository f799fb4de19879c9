"""Peer: compiled memory of MaxText's own training step (loss + gradients), run by long_context.py.

    <maxtext-venv>/bin/python benchmarks/peer_maxtext_memory.py '{"seqs": [1024, 4096], "kernels": ["dot_product"]}'

Runs under MaxText's interpreter (``benchmarks/maxtext_setup.sh``), never zoo's, on CPU with
``DECOUPLE_GCLOUD=TRUE``. The MaxText config is peer_maxtext.py's (``configs/base.yml``, llama2
decoder block, scanned layers, float32 weights and activations) with long_context.py's shape:
Llama 3.2 1B cut to 2 layers (d_model 2048, 32 query heads of 64, 8 KV heads, MLP 8192, vocab
128256, tied embeddings), batch 1, ``remat_policy=full``, ``packing=false``.

For each kernel (``attention=...``) and S: MaxText's model (``models.Transformer``, built
abstractly with ``model_creation_utils.create_nnx_abstract_model``: nothing allocated) and its
training loss (``trainers.pre_train.train.loss_fn``: cross-entropy of the full ``[B, S, V]``
logits, MaxText's default ``num_vocab_tiling=1``), differentiated with respect to the
parameters as ``train_step`` does (``nnx.split`` into Param and the rest, ``jax.value_and_grad``);
lowered with ``jax.ShapeDtypeStruct`` arguments, compiled with the XLA options long_context.py
uses for its own table, and one JSON line printed per (kernel, S): ``memory_analysis()``'s
temp / argument / output / alias bytes, or ``error`` (with ``no_path``, the reason, where the
error is the flash kernel's refusal of the CPU).

What ``attention=flash`` is on CPU (``layers/attention_op.py``, ``AttentionOp.apply_attention``):
MaxText's pure-JAX flash (``kernels/attention/jax_flash_attention.py``, ``use_jax_splash=true``)
is reached only inside ``tpu_flash_attention``, i.e. when the mesh's platform is ``tpu``; on any
other platform ``flash`` calls tokamax's ``PallasTritonFlashAttention`` (a Triton GPU kernel), and
``autoselected`` on CPU is ``dot_product``. The ``flash`` line therefore reports whatever that
does on CPU (the error, if it fails), never a substitute.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from peer_maxtext import overrides  # noqa: E402  (the step-time peer's MaxText config)
from placement import known_compile_options  # noqa: E402  (no JAX at its module level)

NO_FLASH_ON_CPU = (
    "attention=flash off TPU calls tokamax's PallasTritonFlashAttention (a Triton GPU kernel), which raises "
    "NotImplementedError on CPU; MaxText's pure-JAX flash (use_jax_splash) is reached only on TPU, and "
    "attention=autoselected on CPU is dot_product"
)
SHAPE = {  # long_context.py's shape: zoo.llama.preset("llama3.2-1b") cut to 2 layers
    "vocab_size": "128256",
    "base_emb_dim": "2048",
    "base_num_query_heads": "32",
    "base_num_kv_heads": "8",
    "head_dim": "64",
    "base_mlp_dim": "8192",
    "base_num_decoder_layers": "2",
    "logits_via_embedding": "true",  # Llama 3.2 1B ties its embeddings (as zoo's preset does)
    "remat_policy": "full",
}


def config_for(kernel: str, seq: int):
    import maxtext
    from maxtext.configs import pyconfig

    spec = {"model": "llama", "batch": 1, "seq": seq, "steps": 1, "warmup": 0, "platform": "cpu",
            "extra": {**SHAPE, "attention": kernel, "max_target_length": str(seq)}}  # fmt: skip
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return pyconfig.initialize([sys.argv[0], base, "base_output_directory=/tmp/zoo_maxtext_memory",
                                *overrides(spec)])  # fmt: skip


def measure(kernel: str, seq: int, options: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train.train import loss_fn
    from maxtext.utils import maxtext_utils, model_creation_utils

    config = config_for(kernel, seq)
    mesh = maxtext_utils.get_mesh_from_config(config)
    _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)  # ShapeDtypeStructs only
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    data = {k: ids for k in ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_segmentation")}

    def step(params, rest, data):  # train_step's gradient computation, without the optimizer
        def loss(params):
            return loss_fn(nnx.merge(graphdef, params, rest, copy=True), config, dict(data), None, None)[0]

        return jax.value_and_grad(loss)(params)

    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        compiled = jax.jit(step).lower(params, rest, data).compile(options)
    st = compiled.memory_analysis()
    return {"temp": st.temp_size_in_bytes, "args": st.argument_size_in_bytes,
            "outputs": st.output_size_in_bytes, "alias": st.alias_size_in_bytes}  # fmt: skip


def main() -> None:
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    import jax

    try:
        from importlib.metadata import version

        mt_version = version("maxtext")
    except Exception:  # noqa: BLE001
        mt_version = "?"
    options = known_compile_options(spec.get("compile_options", {}))
    for kernel in spec.get("kernels", ["dot_product", "flash"]):
        for seq in spec.get("seqs", [1024]):
            t = time.perf_counter()
            try:
                r = measure(kernel, seq, options)
            except Exception as e:  # noqa: BLE001  (reported, never replaced by a figure)
                r = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
                if kernel == "flash" and isinstance(e, NotImplementedError) and "Not supported on cpu" in str(e):
                    r["no_path"] = NO_FLASH_ON_CPU
            r.update(kernel=kernel, seq=seq, seconds=round(time.perf_counter() - t, 1),
                     versions={"maxtext": mt_version, "jax (maxtext)": jax.__version__})  # fmt: skip
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

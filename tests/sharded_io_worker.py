"""One process of a multi-process sharded I/O check (tests/test_sharded_io.py): load a checkpoint
onto a mesh spanning the processes, make a fresh model and its optimizer state in place, save
the loaded model, and report what this process read and whether its shards hold the right
values. Arguments: CHECKPOINT MESH DEVICES OUT_DIR [option=value ...]; the JAX_* environment
names the coordinator, the process count and this process's id."""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", int(sys.argv[3]))

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zoo  # noqa: E402
from zoo import parallel  # noqa: E402
from zoo.hf import load, save  # noqa: E402
from zoo.params import flatten  # noqa: E402


def main() -> None:
    checkpoint, spec, out = sys.argv[1], sys.argv[2], sys.argv[4]
    options = {k: json.loads(v) for k, v in (a.split("=", 1) for a in sys.argv[5:])}
    gather = options.pop("save_by_gathering", False)  # as if the processes shared no filesystem
    failing = options.pop("fail_writing_on", None)  # this process's writes fail (a full disk)
    lay_out_fails = options.pop("fail_laying_out", False)  # process 0's first file write fails
    check_fresh = options.pop("check_fresh", True)  # fresh init compared bit for bit (under XLA's own settings)
    parallel.initialize_distributed()
    read: list[str] = []
    region = load._TensorSource.region

    def recording(self, key, indices):
        read.append(key)
        return region(self, key, indices)

    load._TensorSource.region = recording
    mesh = parallel.make_mesh(spec)
    model = zoo.from_pretrained(checkpoint, mesh=mesh, **options)
    load._TensorSource.region = region
    whole = flatten(zoo.from_pretrained(checkpoint, **options))  # the reference, read whole (tiny)
    wrong = []

    def check(arrays, reference, what):
        shardings = parallel.param_shardings(model.config, mesh)
        for path, x in arrays.items():
            if not x.sharding.is_equivalent_to(shardings[path], x.ndim):
                wrong.append(f"{what} {path}: sharding {x.sharding.spec}")
            for shard in x.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), np.asarray(reference[path])[shard.index]):
                    wrong.append(f"{what} {path}: shard {shard.index} differs")

    check(flatten(model), whole, "loaded")
    cls = type(model)
    if check_fresh:
        fresh = flatten(cls(model.config, key=jax.random.key(7), mesh=mesh))
        check(fresh, flatten(cls(model.config, key=jax.random.key(7))), "fresh")
    from zoo import train

    tx = train.optimizer(train.TrainConfig(steps=2, warmup=0), model)
    state = parallel.init_optimizer(tx, eqx.filter(model, eqx.is_inexact_array), mesh)
    specs = jax.tree.leaves(parallel.partition_specs(state, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = jax.tree.leaves(state)
    split = 0
    for leaf, spec in zip(leaves, specs, strict=True):
        split += any(spec)
        if not leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim):
            wrong.append(f"optimizer state leaf {leaf.shape}: sharding {leaf.sharding.spec}, not {spec}")
    if not split:
        wrong.append("no optimizer state leaf is split")
    shared, wrote = save._shared_directory, save._write_own_shards
    writes = []
    save._shared_directory = lambda tmp: None if gather and shared(tmp) else shared(tmp)

    def writing(*args):
        writes.append(1)
        if failing == jax.process_index():
            raise OSError(28, "No space left on device")
        wrote(*args)

    save._write_own_shards = writing
    if lay_out_fails and jax.process_index() == 0:

        def full_disk(*args):
            raise OSError(28, "No space left on device")

        save._lay_out = full_disk
    error = None
    try:
        zoo.save_pretrained(model, out)
    except Exception as e:
        error = f"{'CheckpointError' if isinstance(e, zoo.CheckpointError) else type(e).__name__}: {e}"
    print("RESULT " + json.dumps({"process": jax.process_index(), "read": read, "wrong": wrong,
                                  "wrote_own_shards": bool(writes), "error": error}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""One process of the 2-process orbax check (tests/test_sharded_io.py): save a sharded model's
training state with zoo.train's checkpoint manager, then restore it twice, with the target
shardings and fully replicated, counting the bytes this process reads (``rchar`` of
/proc/self/io) against the checkpoint's bytes on disk. Arguments: RUN_DIR; the JAX_* environment names the coordinator and process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import zoo  # noqa: E402
from zoo import parallel, train  # noqa: E402
from zoo.llama import preset  # noqa: E402
from zoo.train import checkpoints  # noqa: E402


def read_bytes() -> int:
    line = next(x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar:"))
    return int(line.split()[1])


def main() -> None:
    run_dir = Path(sys.argv[1])
    parallel.initialize_distributed()
    mesh = parallel.make_mesh("fsdp=4")
    model = zoo.Llama(preset("small"), key=jax.random.key(0), mesh=mesh)
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = train.optimizer(train.TrainConfig(steps=2, warmup=0), model)
    tree = {"params": params, "opt_state": parallel.init_optimizer(tx, params, mesh)}
    manager = checkpoints.open_manager(run_dir, keep=2)
    checkpoints.save(manager, run_dir, 1, tree, on_host=False)
    manager.wait_until_finished()
    # What is on disk (compressed: the fresh moments are zeros), which a whole restore reads.
    total = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "1").rglob("*") if f.is_file())
    sharded = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    replicated = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
                              tree)  # fmt: skip
    from jax.experimental import multihost_utils

    whole = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(tree)]
    figures, wrong = {}, []
    for name, abstract in (("sharded", sharded), ("replicated", replicated)):
        before = read_bytes()
        restored = jax.block_until_ready(manager.restore(1, args=ocp.args.StandardRestore(abstract)))
        figures[name] = (read_bytes() - before) / total
        for a, want, target in zip(jax.tree.leaves(restored), whole, jax.tree.leaves(abstract), strict=True):
            if not a.sharding.is_equivalent_to(target.sharding, a.ndim):
                wrong.append(f"restored {name}: sharding {a.sharding.spec}, asked for {target.sharding.spec}")
            for shard in a.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                    wrong.append(f"restored {name}: shard {shard.index} of a {a.shape} leaf differs")
    manager.close()
    print("RESULT " + json.dumps({"read": figures, "wrong": wrong, "disk_bytes": total}), flush=True)


if __name__ == "__main__":
    main()

"""zoo.plan.collectives: the collective bytes of a traced step against what the compiled HLO moves
(8 simulated CPU devices), and the links a mesh's collectives cross."""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np
import pytest

from zoo import plan, registry
from zoo.errors import ConfigError
from zoo.parallel import AXES
from zoo.plan import collectives
from zoo.plan._step import make_step, mesh_sizes

# Buffers under 2 KiB are left out on both sides: the norms' and routers' small gradients (a
# norm's float32 [D] is 1 KiB in the small preset), and the update's scalar norms GSPMD adds
# outside shard_map, which XLA may fold into other groups.
FLOOR = 2048

CASES = [  # (model type, mesh, the collectives it must have)
    ("llama", "data=2,fsdp=2,tensor=2", {("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",)),
                                         ("all_reduce", ("tensor",)), ("all_reduce", ("data",))}),
    ("deepseek_v3", "fsdp=2,expert=4", {("all_to_all", ("expert",)), ("all_gather", ("fsdp",))}),
    ("llama", "fsdp=4,context=2", {("all_gather", ("context",)), ("reduce_scatter", ("context",))}),
    ("qwen3_moe", "data=2,tensor=2,expert=2", {("all_to_all", ("expert",)), ("all_reduce", ("tensor",))}),
    # The pipeline: hand-overs (collective-permutes), the broadcast of the last stage's output;
    # FSDP's gathers once forward (hoisted out of the tick loop), at every tick backward. A stage
    # of one layer (tiny: 2 layers, 2 stages) and of two (small: 4 layers).
    ("llama", "pipeline=2,data=2,fsdp=2", {("permute", ("pipeline",)), ("all_reduce", ("pipeline",)),
                                           ("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",))}),
    ("llama", "pipeline=2,fsdp=2,tensor=2", {("permute", ("pipeline",)), ("all_gather", ("fsdp",)),
                                             ("all_reduce", ("tensor",))}, "small"),
    # The interleaved schedule (2 chunks of one layer per stage): the hand-overs close the ring,
    # and FSDP gathers each tick's chunk forward and again backward (no tick runs the same weights).
    ("llama", "pipeline=2,data=2,fsdp=2", {("permute", ("pipeline",)), ("all_gather", ("fsdp",)),
                                           ("reduce_scatter", ("fsdp",))}, "small", 2),
]  # fmt: skip


def config(model_type: str, name: str = "tiny"):
    return registry.by_model_type(model_type).config_cls.preset(name, model_type)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" + (f"-v{c[4]}" if len(c) > 4 else "") for c in CASES])
def test_traced_collective_bytes_equal_the_compiled_hlo(case):
    """FSDP gathers and reduce-scatters, tensor all-reduces, expert all-to-alls, context K/V
    gathers, the batch axes' gradient all-reduce and the pipeline's hand-overs: per kind and
    mesh axes, the bytes counted on the traced step (scans times their length) are the bytes
    XLA's program moves (its while loops times their trip counts)."""
    model_type, mesh, expected, *preset = case
    virtual = preset.pop() if len(preset) > 1 else 1
    step = make_step(config(model_type, *preset), batch_size=8, seq_len=64, mesh=mesh, placement="remat",
                     virtual_stages=virtual)  # fmt: skip
    jaxpr, compiled = step.compile()
    counted = collectives.totals(collectives.traced(jaxpr, step.sizes), floor=FLOOR)
    hlo = collectives.hlo_traffic(compiled.as_text(), step.sizes, floor=FLOOR)
    assert expected <= set(counted), (sorted(counted), expected)
    assert counted == hlo


@pytest.mark.parametrize(
    "over, groups",
    [  # jaxlib 0.10.2's listing of the same program's groups (1 x 2 x 4 mesh: data, fsdp, expert)
        ("'expert'", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("'fsdp'", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("'fsdp','expert'", [list(range(8))]),
    ],
)
def test_replica_groups_read_in_each_spelling(over, groups):
    """jaxlib 0.12.1 gives a collective's groups as its mesh and axes, where 0.10.2 listed them:
    both read as the same device groups (the collectives' bytes were 0 on 0.12.1 before)."""
    listed = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    old = f"%all-to-all = f32[8,16] all-to-all(%p), channel_id=1, replica_groups={listed}, dimensions={{0}}"
    new = f"%all-to-all = f32[8,16] all-to-all(%p), channel_id=1, replica_groups=mesh['data'=1,'fsdp'=2,'expert'=4] {{{over}}}, dimensions={{0}}"
    assert collectives._groups(old, 8) == collectives._groups(new, 8) == groups


def test_a_ragged_all_to_all_is_read_at_what_it_can_send():
    """``hlo_traffic`` reads a ragged all-to-all (the MoE dispatch's transport on GPU and TPU) as
    the smaller of its operand and output, whether the operands' shapes are printed inline or,
    as XLA:TPU prints them, by name only (the lines are XLA:TPU's, 2026-12-06, shortened)."""
    by_name = """HloModule m
ENTRY %main (p: f32[64,512]) -> f32[160,512] {
  %rows = f32[64,512]{1,0} parameter(0)
  %zeros = f32[160,512]{1,0} broadcast(f32[] %c), dimensions={}
  %io = s32[8]{0} iota(), iota_dimension=0
  ROOT %ragged_all_to_all.299 = f32[160,512]{1,0} ragged-all-to-all(%rows, %zeros, %io, %io, %io, /*index=5*/%io), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
}
"""
    inline = by_name.replace(
        "ragged-all-to-all(%rows, %zeros", "ragged-all-to-all(f32[64,512]{1,0} %rows, f32[160,512]{1,0} %zeros"
    )
    back = by_name.replace("(%rows, %zeros", "(%zeros, %rows").replace(
        "ROOT %ragged_all_to_all.299 = f32[160,512]", "ROOT %ragged_all_to_all.299 = f32[64,512]"
    )
    for hlo in (by_name, inline, back):
        assert collectives.hlo_traffic(hlo, {"expert": 8}) == {("all_to_all", ("expert",)): 64 * 512 * 4}


def test_links_follow_the_device_order():
    """The last mesh axes vary fastest: on 8-GPU HGX nodes tensor=8 stays on NVLink and a data
    axis over the nodes crosses InfiniBand; on a 72-GPU NVLink domain fsdp=8 after tensor=8
    (64 devices) stays inside, fsdp=16 (128 devices) crosses."""
    h100, gb200 = plan.hardware("h100"), plan.hardware("gb200")
    sizes = mesh_sizes("data=4,tensor=8")
    assert collectives.link(h100, sizes, ("tensor",)) == h100.domain_link
    assert collectives.link(h100, sizes, ("data",)) == h100.cross_link
    assert collectives.link(gb200, mesh_sizes("fsdp=8,tensor=8"), ("fsdp",)) == gb200.domain_link
    assert collectives.link(gb200, mesh_sizes("fsdp=16,tensor=8"), ("fsdp",)) == gb200.cross_link
    # An axis whose groups are not aligned with the domains crosses: 9 x 8 = 72 on 8-GPU nodes.
    assert collectives.crosses(mesh_sizes("data=8,tensor=9"), ("tensor",), 8)
    assert not collectives.crosses(mesh_sizes("data=9,tensor=8"), ("tensor",), 8)
    # A ring all-gather moves (n-1)/n of the buffer through each device, an all-reduce twice that.
    assert collectives.seconds("all_gather", 8e9, 8, 1e9) == pytest.approx(7.0)
    assert collectives.seconds("all_reduce", 8e9, 8, 1e9) == pytest.approx(14.0)


def test_collectives_across_tpu_slices_are_hierarchical():
    """XLA runs a multislice all-gather, reduce-scatter or all-reduce in two stages: the ring in
    the slice on ICI over all the bytes, the ring across slices on DCN over 1/(chips in the
    slice) of them. A flat ring at DCN priced 405B's fsdp=512 on 2 x v6e-256 at 0.28 of its
    published step. An all-to-all sends only the other slice's share over DCN."""
    v6e = plan.hardware("tpu-v6e")
    sizes = mesh_sizes("fsdp=512")
    assert collectives.spans(sizes, ("fsdp",), v6e.domain) == 2
    assert collectives.spans(mesh_sizes("fsdp=128,tensor=4"), ("tensor",), v6e.domain) == 1
    nbytes = 2.56e9
    two_stage = 255 / 256 * nbytes / v6e.domain_link + 1 / 2 * nbytes / 256 / v6e.cross_link
    assert collectives.collective_seconds("all_gather", nbytes, v6e, sizes, ("fsdp",)) == pytest.approx(two_stage)
    assert collectives.collective_seconds("all_reduce", nbytes, v6e, sizes, ("fsdp",)) == pytest.approx(2 * two_stage)
    flat = collectives.seconds("all_gather", nbytes, 512, v6e.cross_link)
    assert flat > 25 * two_stage
    assert collectives.collective_seconds("all_to_all", nbytes, v6e, sizes, ("fsdp",)) == pytest.approx(
        256 / 512 * nbytes / v6e.cross_link
    )
    # Inside one slice: one ring on ICI.
    assert collectives.collective_seconds(
        "all_gather", nbytes, v6e, mesh_sizes("fsdp=256"), ("fsdp",)
    ) == pytest.approx(collectives.seconds("all_gather", nbytes, 256, v6e.domain_link))


def test_gpu_rings_across_nodes_share_the_nodes_network_links():
    """A ring across GPU nodes was priced at one NIC's 50 GB/s for all its bytes: NCCL runs a
    ring per channel, each crossing on another GPU's NIC, so the bus bandwidth nccl-tests reports
    across nodes grows with the GPUs per node (NVIDIA/nccl#1168: ~45 -> ~90 GB/s from 4 to 8;
    #2409: ~470 GB/s expected on 2 x 8 H100 at 400 Gb/s each). Now the m devices of a group in a
    domain carry its crossing bytes together, up to the domain's own link; a group with one device
    per node keeps one NIC; an all-to-all sends only the other domains' share across."""
    h100, gb200 = plan.hardware("h100"), plan.hardware("gb200")
    nbytes = 1.6e9

    def ring(hw, sizes, axes):
        return collectives.collective_seconds("all_gather", nbytes, hw, sizes, axes)

    # fsdp=16 on two 8-GPU nodes: 8 NICs a node, 400 GB/s (below NVLink's 450).
    assert collectives.fewest_inside(mesh_sizes("fsdp=16"), ("fsdp",), 8) == 8
    assert ring(h100, mesh_sizes("fsdp=16"), ("fsdp",)) == pytest.approx(15 / 16 * nbytes / (8 * h100.cross_link))
    # data=4 over nodes with tensor=8 inside: one GPU of each group a node, one NIC.
    assert ring(h100, mesh_sizes("data=4,tensor=8"), ("data",)) == pytest.approx(3 / 4 * nbytes / h100.cross_link)
    # The seed's fsdp=16 after expert=8 on 128 GB200 (72 a domain): 9 and 7 of a group on each side.
    seed = mesh_sizes("fsdp=16,expert=8")
    assert collectives.spans(seed, ("fsdp",), 72) == 2 and collectives.fewest_inside(seed, ("fsdp",), 72) == 7
    assert ring(gb200, seed, ("fsdp",)) == pytest.approx(15 / 16 * nbytes / (7 * gb200.cross_link))
    flat = collectives.seconds("all_gather", nbytes, 16, gb200.cross_link)
    assert flat == pytest.approx(7 * ring(gb200, seed, ("fsdp",)))
    # Many devices a domain: the ring is as fast as NVLink inside, never faster.
    wide = mesh_sizes("fsdp=144")
    assert ring(gb200, wide, ("fsdp",)) == pytest.approx(143 / 144 * nbytes / gb200.domain_link)
    assert collectives.collective_seconds("all_reduce", nbytes, gb200, wide, ("fsdp",)) == pytest.approx(
        2 * ring(gb200, wide, ("fsdp",))
    )
    # expert=16 on two nodes: half of each device's all-to-all bytes cross, on its own NIC.
    a2a = collectives.collective_seconds("all_to_all", nbytes, h100, mesh_sizes("expert=16"), ("expert",))
    assert a2a == pytest.approx(8 / 16 * nbytes / h100.cross_link)
    # A permute (a pipeline's hand-over) sends its buffer once on the link it crosses.
    hand_over = collectives.collective_seconds("permute", nbytes, h100, mesh_sizes("pipeline=2,fsdp=8"), ("pipeline",))
    assert hand_over == pytest.approx(nbytes / h100.cross_link)


def test_a_job_placed_64_gpus_a_rack_keeps_its_expert_groups_on_nvlink():
    """Megatron-Bridge's DeepSeek-V3 on 256 GB200 (`pipeline=4,expert=64`) was priced at 857
    tokens/s per GPU against 3,139 published: numbered in 72-GPU domains, three of its four
    64-GPU expert groups straddle two racks (8 and 56), and their all-to-alls cross on the NICs.
    NVIDIA places such jobs 16 trays (64 GPUs) a rack (Slurm's --segment 16): with
    ``hardware("gb200", domain=64)`` the groups stay on NVLink."""
    gb200, job = plan.hardware("gb200"), plan.hardware("gb200", domain=64)
    assert job.domain == 64 and job.efficiency == gb200.efficiency and job.cross_link == gb200.cross_link
    sizes, nbytes = mesh_sizes("pipeline=4,expert=64"), 1e9
    assert collectives.spans(sizes, ("expert",), 72) == 2 and collectives.fewest_inside(sizes, ("expert",), 72) == 8
    a2a = functools.partial(collectives.collective_seconds, "all_to_all", nbytes, sizes=sizes, axes=("expert",))
    assert a2a(gb200) == pytest.approx(56 / 64 * nbytes / gb200.cross_link)
    assert a2a(job) == pytest.approx(63 / 64 * nbytes / job.domain_link)
    for bad in (0, 73, True):
        with pytest.raises(ConfigError, match=r"domain must be a device count from 1 to gb200's 72"):
            plan.hardware("gb200", domain=bad)


def test_a_hardware_without_link_figures_is_refused():
    bare = dataclasses.replace(plan.hardware("h100"), name="h100-no-ib", cross_link=0.0)
    with pytest.raises(ConfigError, match=r"'h100-no-ib' has no link figure across its fast domains \(cross_link"):
        collectives.link(bare, mesh_sizes("fsdp=16"), ("fsdp",))
    assert collectives.link(bare, mesh_sizes("fsdp=8"), ("fsdp",)) == bare.domain_link


def _spans_by_device_ids(sizes, axes, domain):
    """The span by brute force: every device's id, grouped along ``axes``."""
    ids = np.arange(math.prod(sizes[a] for a in AXES)).reshape([sizes[a] for a in AXES])
    idx = [AXES.index(a) for a in axes]
    rest = [i for i in range(len(AXES)) if i not in idx]
    groups = np.sort(ids.transpose(rest + idx).reshape(-1, math.prod(sizes[a] for a in axes)) // domain, axis=1)
    return int(1 + (np.diff(groups, axis=1) != 0).sum(axis=1).max())


def _fewest_by_device_ids(sizes, axes, domain):
    """The fewest devices of a group inside one domain, by brute force."""
    ids = np.arange(math.prod(sizes[a] for a in AXES)).reshape([sizes[a] for a in AXES])
    idx = [AXES.index(a) for a in axes]
    rest = [i for i in range(len(AXES)) if i not in idx]
    groups = ids.transpose(rest + idx).reshape(-1, math.prod(sizes[a] for a in axes)) // domain
    return int(min(np.unique(g, return_counts=True)[1].min() for g in groups))


def test_spans_come_from_the_mesh_shape():
    """#42.8: spans is computed from the shape (one group per base residue, cached), the same as
    grouping every device id; 100,000 devices take no device array per collective."""
    for spec in ("data=3,fsdp=4,tensor=6", "pipeline=2,fsdp=9,expert=4", "data=8,tensor=9", "fsdp=6,context=2"):
        sizes = mesh_sizes(spec)
        for axes in (("tensor",), ("fsdp",), ("data", "fsdp"), ("fsdp", "expert"), ("pipeline", "context")):
            for domain in (1, 4, 8, 9, 16, 72):
                assert collectives.spans(sizes, axes, domain) == _spans_by_device_ids(sizes, axes, domain), (spec, axes)
                if math.prod(sizes.values()) > domain:
                    assert collectives.fewest_inside(sizes, axes, domain) == _fewest_by_device_ids(sizes, axes, domain)
    start = time.perf_counter()
    assert collectives.spans(mesh_sizes("data=12500,fsdp=8"), ("data",), 72) == 12500 * 8 // 72 + 1
    assert collectives.spans(mesh_sizes("fsdp=100000"), ("fsdp",), 8) == 12500
    assert time.perf_counter() - start < 2.0

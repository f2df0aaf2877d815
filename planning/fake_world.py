"""One process playing one rank of a world of any size: torch's fake process group.

torch.distributed's "fake" backend (registered by torch.testing._internal.distributed.fake_pg,
a test utility and the only way torch offers) accepts every collective without talking to anyone,
so the real mesh, FSDP, TP and pipeline code runs for rank r of N in one process. Meshes are
built on "cpu" (a meta-device mesh breaks fully_shard).
"""

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from parallelisms.parallel_dims import ParallelDims


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as `rank` of `world_size` until the block ends."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend)
    from torch._C._distributed_c10d import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_group_names(dims: ParallelDims) -> dict[str, str]:
    """Process-group name → the mesh dimension it spans, for the collective counts. The world
    mesh's dimensions name a group first (a flattened view that is the same group keeps that
    name); an expert-mesh dimension over the same ranks is added, e.g. "dp_shard = ep"; the experts'
    HSDP replicas are dp_replicate's (their own groups, over the same span)."""
    names: dict[str, str] = {}
    for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp", "dp", "dp_shard_cp", "dp_cp"):
        mesh = dims.mesh(name)
        if mesh is not None:
            names.setdefault(mesh.get_group().group_name, name)
    fsdp = dims.fsdp_mesh()
    if fsdp is not None and fsdp.ndim == 2:  # HSDP/DDP's own (dp_replicate, dp_shard_cp) groups
        for name in fsdp.mesh_dim_names:
            names.setdefault(fsdp[name].get_group().group_name, name)
    for name in ("ep", "dp_shard_mod_ep"):
        mesh = dims.mesh(name)
        if mesh is not None and mesh.size() > 1:
            group = mesh.get_group().group_name
            names[group] = f"{names[group]} = {name}" if group in names else name
    if dims.expert_mesh is not None and dims.dp_replicate > 1:  # HSDP's replicas of the experts
        replicas = dims.expert_fsdp_mesh()["dp_replicate"]
        names.setdefault(replicas.get_group().group_name, "dp_replicate")
    return names

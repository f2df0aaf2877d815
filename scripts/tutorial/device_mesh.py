"""DeviceMesh (16.6): name the axes of a grid of ranks, and get one process group per row and per column.

    python scripts/tutorial/device_mesh.py                           # 8 processes: 2 x 4, then 2 x 2 x 2
    python scripts/tutorial/device_mesh.py --mesh-2d 2,2 --mesh-3d 1,2,2  # 4 processes

Part 1 lays 8 ranks out as 2 replicas x 4 model-parallel parts. init_device_mesh builds the process groups
of both axes: one group per row ("model_parallel": the parts of one replica) and one per column
("replicate": the copies of one part). Every rank reads its own groups from the mesh; rank 0 gathers and
prints them. Then the replicas of each part, initialised differently, average their parameters with an
all_reduce on the "replicate" group, and the parts of each replica all_gather their shapes on the
"model_parallel" group. Part 2 (the chapter's exercise) does the same bookkeeping for a 3-D mesh
("dp", "pp", "tp"). Both parts check every group against the coordinates the mesh gives each rank.
"""

import argparse
import math
import sys
from itertools import pairwise
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_in_rank_order, spawn_world  # noqa: E402

NAMES_2D = ("replicate", "model_parallel")
NAMES_3D = ("dp", "pp", "tp")
BATCH = 3


def mesh_rows(mesh: DeviceMesh) -> list[tuple[int, tuple[int, ...], dict[str, list[int]]]]:
    """Every rank's (rank, coordinate, {dim name: ranks of its group along that dim}), gathered on all ranks.

    Each rank only knows its own groups, so the table is assembled with an all_gather_object.
    """
    mine = (dist.get_rank(), tuple(mesh.get_coordinate()),
            {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names})
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return sorted(rows)


def print_group_table(mesh: DeviceMesh, rows: list) -> None:
    """Rank 0 prints each rank's coordinate and groups, then the distinct groups of every dimension."""
    names = mesh.mesh_dim_names
    print(f"the mesh (rank at each coordinate):\n{mesh.mesh}")
    width = max(len("coordinate"), 3 * len(names) - 1)
    print(f"  rank  {'coordinate':<{width}}  " + "  ".join(f"{name:>16}" for name in names))
    for rank, coord, groups in rows:
        cells = "  ".join(f"{str(groups[name]):>16}" for name in names)
        print(f"  {rank:>4}  {str(coord):<{width}}  {cells}")
    total = 0
    for name in names:
        distinct = sorted({tuple(groups[name]) for _, _, groups in rows})
        total += len(distinct)
        print(f'along "{name}" (size {mesh[name].size()}): {len(distinct)} groups')
        for i, ranks in enumerate(distinct):
            print(f"  dim {name}: group {i}: ranks {list(ranks)}")
    print(f"{total} process groups in all")


def check_groups(mesh: DeviceMesh, rows: list) -> int:
    """Each group along a dim must hold exactly the ranks whose other coordinates equal this rank's.

    Also checks each rank's coordinate against the grid: mesh.mesh[coordinate] must be the rank.
    """
    names, checked = mesh.mesh_dim_names, set()
    for rank, coord, groups in rows:
        if mesh.mesh[coord].item() != rank:
            raise RuntimeError(f"rank {rank} has coordinate {coord}, where the grid holds {mesh.mesh[coord]}")
        for d, name in enumerate(names):
            others = coord[:d] + coord[d + 1:]
            expected = sorted(r for r, c, _ in rows if c[:d] + c[d + 1:] == others)
            if groups[name] != expected:
                raise RuntimeError(f"rank {rank}: group along {name} is {groups[name]}, expected {expected}")
            checked.add((name, tuple(expected)))
    return len(checked)


def model_part(replica: int, part: int, n_parts: int) -> nn.Linear:
    """Part `part` of the model as replica `replica` initialises it: widths shrink by one from part to part.

    The seed depends on both, so the two copies of a part start different until they are averaged.
    """
    torch.manual_seed(1000 * replica + part)
    return nn.Linear(n_parts + 2 - part, n_parts + 1 - part)


def fmt(t: torch.Tensor) -> str:
    """A 1-D tensor as a bracketed list of 6-decimal numbers, easy to read and to parse."""
    return "[" + ", ".join(f"{v:.6f}" for v in t.tolist()) + "]"


def average_replicas(mesh: DeviceMesh, device: torch.device) -> None:
    """Average every part's parameters over the "replicate" dim and check the result on each rank."""
    replica, part = mesh.get_coordinate()
    n_replicas, n_parts = mesh["replicate"].size(), mesh["model_parallel"].size()
    layer = model_part(replica, part, n_parts).to(device)
    before = layer.weight[0].detach().cpu().clone()

    replicate_group = mesh["replicate"].get_group()
    with torch.no_grad():
        for p in layer.parameters():
            dist.all_reduce(p, op=dist.ReduceOp.SUM, group=replicate_group)  # gloo has no ReduceOp.AVG
            p /= n_replicas

    # Independent answer: this rank rebuilds every replica of its part and averages them itself.
    copies = [model_part(r, part, n_parts) for r in range(n_replicas)]
    diff_mean = 0.0
    for name, p in layer.named_parameters():
        mean = torch.stack([getattr(c, name).detach() for c in copies]).mean(0)
        diff_mean = max(diff_mean, (p.detach().cpu() - mean).abs().max().item())
    # The replicas must also agree with each other, bit for bit: gather them all and compare.
    flat = torch.cat([p.detach().flatten() for p in layer.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(n_replicas)]
    dist.all_gather(gathered, flat, group=replicate_group)
    diff_replicas = max((g - flat).abs().max().item() for g in gathered)
    print_in_rank_order(
        f"rank {dist.get_rank()} (replica {replica}, part {part}, weight {tuple(layer.weight.shape)}): "
        f"row 0 before {fmt(before)} after {fmt(layer.weight[0].detach().cpu())}")
    worst = torch.tensor([diff_mean, diff_replicas], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst.max().item() > 1e-6:
        raise RuntimeError(f"averaging over replicate went wrong: {worst.tolist()}")
    if dist.get_rank() == 0:
        print(f"check: averaged over replicate, every part equals the mean its rank computed itself "
              f"(max abs diff {worst[0].item():.1e}) and its replicas agree "
              f"(max abs diff {worst[1].item():.1e})", flush=True)


def gather_part_shapes(mesh: DeviceMesh, device: torch.device) -> None:
    """All_gather (input width, output shape) of every part over "model_parallel": each part of a replica
    learns what its neighbours consume and produce, and the chain must connect."""
    replica, part = mesh.get_coordinate()
    layer = model_part(replica, part, mesh["model_parallel"].size()).to(device)
    out = layer(torch.randn(BATCH, layer.in_features, device=device))
    mine = torch.tensor([layer.in_features, *out.shape], device=device)
    shapes = [torch.empty_like(mine) for _ in range(mesh["model_parallel"].size())]
    dist.all_gather(shapes, mine, group=mesh["model_parallel"].get_group())
    shapes = [s.tolist() for s in shapes]
    for (_, _, width), (nxt_in, _, _) in pairwise(shapes):
        if width != nxt_in:
            raise RuntimeError(f"parts do not chain: {shapes}")
    chain = ", ".join(f"part {c}: [{b}, {i}] -> [{b}, {o}]" for c, (i, b, o) in enumerate(shapes))
    for turn in range(dist.get_world_size()):  # one line per replica, from its first part, in rank order
        if turn == dist.get_rank() and mesh["model_parallel"].get_local_rank() == 0:
            print(f"replica {replica} (rank {turn}) all_gathered over model_parallel: {chain}", flush=True)
        dist.barrier()


def run(rank: int, world: int, device: torch.device, shape_2d: tuple[int, ...],
        shape_3d: tuple[int, ...]) -> None:
    """Build both meshes, print and check their groups, then use the 2-D mesh's groups."""
    mesh = init_device_mesh(device.type, shape_2d, mesh_dim_names=NAMES_2D)
    rows = mesh_rows(mesh)
    if rank == 0:
        print(f"== 2-D mesh {shape_2d[0]} x {shape_2d[1]} {NAMES_2D} on {world} ranks ({device.type}) ==")
        print_group_table(mesh, rows)
        n = check_groups(mesh, rows)
        print(f"check: 2-D mesh: each of the {n} groups holds exactly the ranks that share the other "
              "coordinate")
        print(f'\n== average the replicas over "replicate" (all_reduce SUM / {shape_2d[0]}) ==', flush=True)
    dist.barrier()
    average_replicas(mesh, device)
    if rank == 0:
        print('\n== a collective inside each replica: all_gather over "model_parallel" ==', flush=True)
    dist.barrier()
    gather_part_shapes(mesh, device)

    mesh3 = init_device_mesh(device.type, shape_3d, mesh_dim_names=NAMES_3D)
    rows3 = mesh_rows(mesh3)
    if rank == 0:
        print(f"\n== exercise: 3-D mesh {' x '.join(map(str, shape_3d))} {NAMES_3D} ==")
        print_group_table(mesh3, rows3)
        n = check_groups(mesh3, rows3)
        print(f"check: 3-D mesh: each of the {n} groups holds exactly the ranks that share the other two "
              "coordinates", flush=True)
    dist.barrier()


def shape_arg(text: str) -> tuple[int, ...]:
    """'2,4' -> (2, 4)."""
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    """Parse the two mesh shapes and spawn one process per rank of them."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh-2d", type=shape_arg, default=(2, 4), help="replicas,parts (default 2,4)")
    parser.add_argument("--mesh-3d", type=shape_arg, default=(2, 2, 2), help="dp,pp,tp (default 2,2,2)")
    args = parser.parse_args()
    world = math.prod(args.mesh_2d)
    if len(args.mesh_2d) != 2 or len(args.mesh_3d) != 3 or math.prod(args.mesh_3d) != world:
        parser.error("--mesh-2d needs 2 sizes, --mesh-3d 3, and both must multiply to the same world size")
    spawn_world(run, world, args.mesh_2d, args.mesh_3d)


if __name__ == "__main__":
    main()

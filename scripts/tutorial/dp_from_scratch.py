"""Data parallel from scratch (section 16.4): three ways to average gradients, each checked against DDP.

    python scripts/tutorial/dp_from_scratch.py                          # 2 ranks, 2 KiB buckets, 3 steps
    python scripts/tutorial/dp_from_scratch.py --world-size 3 --bucket-cap-kb 4 --steps 5

Every rank builds the same model (same seed) and draws a different batch, so after backward the ranks hold
different gradients. Data parallel training averages them before the optimizer step, so every replica takes
the same step and the replicas never drift apart. The script does the averaging three ways:

  (a) naive: one all_reduce per parameter gradient, then a division by the world size;
  (b) bucketed: the gradients, last parameter first (backward produces them in that order), packed into
      flat buckets of at most --bucket-cap-kb; one all_reduce per bucket, then the results copied back;
  (c) bucketed and overlapped: a hook on every parameter notes when its gradient is accumulated; as soon as
      a bucket is complete its all_reduce is launched asynchronously, while backward goes on computing the
      earlier layers' gradients; after backward we wait for every launched all_reduce.

(c) is what torch.nn.parallel.DistributedDataParallel does (its C++ Reducer). Each way is compared with
DDP's gradients on the same model and data; the all_reduce calls are counted twice: by our own counter
around the calls we make, and by a dispatch mode that sees every c10d collective op, DDP's included.
Finally (c) and DDP train side by side for a few SGD steps and must keep identical parameters.

Two details of DDP show in the output. Its first backward reduces everything in one bucket: it does not
know yet in which order the gradients will arrive, so after that backward it rebuilds its buckets in the
observed order (the two broadcasts of step 2 share the new layout from rank 0). And it closes a bucket once
the bucket reaches the cap, so its buckets may overshoot the cap by one tensor, while ours stay under it:
the same cap can give DDP fewer buckets than us.
"""

import argparse
from collections import Counter
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import print_in_rank_order, spawn_world
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH, CLASSES, LAYERS = 16, 4, 6
TOL = 1e-6


def make_model(device: torch.device) -> nn.Sequential:
    """Six Linear layers with biases (twelve small tensors); the fixed seed makes every rank's copy equal."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        last = i == LAYERS - 1
        layers.append(nn.Linear(WIDTH, CLASSES if last else WIDTH))
        if not last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device)


def local_batch(rank: int, step: int, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for this step: a different seed per (step, rank), so ranks see different data."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, WIDTH, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    return x.to(device), y.to(device)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model on one batch."""
    return F.cross_entropy(model(x), y)


class Comm:
    """The only way our three methods reach the network: every all_reduce they issue is counted here."""

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Sum tensor over all ranks in place (asynchronously if asked), counting the call."""
        self.calls += 1
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)


class C10dOps(TorchDispatchMode):
    """Counts the c10d collective ops reaching the dispatcher while active: ours and DDP's Reducer's alike."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Note a c10d op by name (e.g. allreduce_), then run whatever op it is unchanged."""
        if str(func).startswith("c10d."):
            self.ops[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def plan_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Parameter indices, last first, in buckets of at most cap_bytes (a bigger tensor gets its own)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def flatten(grads: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of the gradients, so one collective can carry them all."""
    return torch.cat([g.reshape(-1) for g in grads])


def unflatten_into(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Copy the pieces of a flat bucket back into the gradients it was made of."""
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def sync_naive(params: list[torch.Tensor], comm: Comm, world: int) -> None:
    """(a) Average gradients with one all_reduce per parameter: many tiny messages."""
    for p in params:
        comm.all_reduce(p.grad)
        p.grad.div_(world)


def sync_bucketed(params: list[torch.Tensor], buckets: list[list[int]], comm: Comm, world: int) -> None:
    """(b) Average gradients with one all_reduce per bucket, after backward has finished."""
    for bucket in buckets:
        grads = [params[i].grad for i in bucket]
        flat = flatten(grads)
        comm.all_reduce(flat)
        unflatten_into(flat.div_(world), grads)


class OverlappedSync:
    """(c) Launch each bucket's all_reduce inside backward, as soon as its last gradient is accumulated."""

    def __init__(self, params: list[torch.Tensor], buckets: list[list[int]], comm: Comm, world: int) -> None:
        self.params, self.buckets, self.comm, self.world = params, buckets, comm, world
        self.bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket}
        self.hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
                      for i, p in enumerate(params)]
        self.start()

    def start(self) -> None:
        """Forget the last step: no gradient ready, no bucket launched."""
        self.missing = [len(bucket) for bucket in self.buckets]
        self.next_bucket = 0
        self.grads_ready = 0
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.launched_after: list[int] = []  # for each bucket: how many gradients were ready at its launch

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """Hook: param.grad is final for this backward; launch every bucket that is now complete."""
        self.grads_ready += 1
        self.missing[self.bucket_of[index]] -= 1
        # Launch strictly in bucket order: all ranks must issue their collectives in the same order,
        # whatever order their own backward happened to finish the buckets in (DDP does the same).
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            flat = flatten([self.params[i].grad for i in self.buckets[self.next_bucket]])
            work = self.comm.all_reduce(flat, async_op=True)
            self.in_flight.append((self.next_bucket, flat, work))
            self.launched_after.append(self.grads_ready)
            self.next_bucket += 1

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self.hooks:
            hook.remove()

    def finish(self) -> None:
        """After backward: wait for every bucket's all_reduce and copy the averages into the gradients."""
        if self.next_bucket != len(self.buckets):
            raise RuntimeError(f"only {self.next_bucket} of {len(self.buckets)} buckets were launched")
        for b, flat, work in self.in_flight:
            work.wait()
            unflatten_into(flat.div_(self.world), [self.params[i].grad for i in self.buckets[b]])


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over paired tensors, maximised over all ranks too, so every rank sees one number."""
    local = max((x - y).abs().max() for x, y in zip(a, b, strict=True)).reshape(1).double()
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.item()


def check(what: str, diff: float, rank: int, tol: float = TOL) -> None:
    """Print `check: ...` on rank 0; raise on every rank when the difference exceeds the tolerance."""
    if diff > tol:
        raise RuntimeError(f"check failed: {what} differs (max abs diff {diff:.1e} > {tol:.0e})")
    if rank == 0:
        print(f"check: {what} matches (max abs diff {diff:.1e})", flush=True)


def describe(params: list[torch.Tensor], buckets: list[list[int]]) -> str:
    """A bucket layout as `[11 10 9] 1360 B | ...` (parameter indices, then the bucket's size)."""
    return " | ".join(
        f"[{' '.join(map(str, b))}] {sum(params[i].numel() * params[i].element_size() for i in b)} B"
        for b in buckets)


def ddp_layout(ddp: DDP) -> list[list[int]]:
    """DDP's current buckets as parameter indices, read from its Reducer (a private but stable hook)."""
    position = {id(p): i for i, p in enumerate(ddp.parameters())}
    return [[position[id(p)] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def wrap_ddp(device: torch.device, cap_kb: float) -> DDP:
    """The same model under DDP, with the same bucket cap as ours."""
    ids = [device.index] if device.type == "cuda" else None
    return DDP(make_model(device), device_ids=ids, bucket_cap_mb=cap_kb / 1024)


METHODS = {"naive": "(a) naive, one per parameter", "bucketed": "(b) bucketed",
           "overlapped": "(c) bucketed + overlapped"}


def backward_and_sync(method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      buckets: list[list[int]], comm: Comm, world: int) -> OverlappedSync | None:
    """Backward on the local batch with the gradients averaged one of our three ways."""
    params = list(model.parameters())
    overlapped = OverlappedSync(params, buckets, comm, world) if method == "overlapped" else None
    loss_of(model, x, y).backward()
    if method == "naive":
        sync_naive(params, comm, world)
    elif method == "bucketed":
        sync_bucketed(params, buckets, comm, world)
    else:
        overlapped.finish()
        overlapped.remove()
    return overlapped


def show(t: torch.Tensor) -> str:
    """A small tensor as a readable list with six decimals."""
    return "[" + ", ".join(f"{v:+.6f}" for v in t.tolist()) + "]"


def compare_gradients(rank: int, world: int, device: torch.device, cap_kb: float, batch: int) -> list:
    """One backward on each rank's batch, averaged our three ways and by DDP; returns our bucket plan."""
    x, y = local_batch(rank, 0, batch, device)
    comm = Comm()

    # DDP first: its gradients are the reference. Its first backward uses one bucket for everything
    # (it does not know yet in which order gradients arrive); the second uses the rebuilt buckets.
    ddp = wrap_ddp(device, cap_kb)
    ddp_ops, ddp_buckets, ddp_grads = [], [], []
    for _ in range(2):
        ddp.zero_grad()
        with C10dOps() as ops:
            loss_of(ddp, x, y).backward()
        ddp_ops.append(ops.ops)
        ddp_buckets.append(ddp_layout(ddp))
        ddp_grads.append([p.grad.clone() for p in ddp.parameters()])
    first_grads, ddp_grads = ddp_grads

    local = make_model(device)  # no synchronisation at all: what this rank alone computes
    loss_of(local, x, y).backward()
    params = list(local.parameters())
    buckets = plan_buckets(params, int(cap_kb * 1024))

    rows, averaged = [], {}
    for method, label in METHODS.items():
        model = make_model(device)
        comm.calls = 0
        with C10dOps() as ops:
            overlapped = backward_and_sync(method, model, x, y, buckets, comm, world)
        grads = [p.grad for p in model.parameters()]
        averaged[method] = grads
        rows.append((label, comm.calls, ops.ops["allreduce_"], max_diff(grads, ddp_grads)))

    # An independent reference for DDP itself: one process, the whole global batch.
    xs, ys = [torch.empty_like(x) for _ in range(world)], [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    single = make_model(device)
    loss_of(single, torch.cat(xs), torch.cat(ys)).backward()

    print_in_rank_order(f"rank {rank}: last bias grad, local    {show(params[-1].grad)}\n"
                        f"        averaged by (a)      {show(averaged['naive'][-1])}")
    if rank == 0:
        print(f"\nour buckets (<= {cap_kb:g} KiB; parameter indices, last first): "
              f"{describe(params, buckets)}")
        print(f"DDP's buckets, first backward: {describe(params, ddp_buckets[0])}")
        print(f"DDP's buckets, rebuilt in the order gradients arrived (a bucket closes once it reaches the "
              f"cap): {describe(params, ddp_buckets[1])}")
        print(f"(c) launched its buckets after {overlapped.launched_after} of {len(params)} gradients "
              f"were ready: every launch but the last happened during backward\n")
        print(f"{'method':30} {'all_reduce calls/step':>22} {'c10d all_reduce ops':>20} "
              f"{'max |grad - DDP|':>17}")
        for label, calls, seen, diff in rows:
            print(f"{label:30} {calls:>22} {seen:>20} {diff:>17.1e}")
        for label, ops in (("DDP, first backward", ddp_ops[0]), ("DDP, buckets rebuilt", ddp_ops[1])):
            print(f"{label:30} {'-':>22} {ops['allreduce_']:>20} {'reference':>17}")
        print(flush=True)
    for label, _, _, diff in rows:
        check(f"{label}: averaged gradient vs DDP's", diff, rank)
    check("DDP's first backward (one bucket) vs its second", max_diff(first_grads, ddp_grads), rank)
    single_grads = [p.grad for p in single.parameters()]
    check("DDP vs one process on the global batch", max_diff(ddp_grads, single_grads), rank)
    expected = [len(params), len(buckets), len(buckets)]
    if [(calls, seen) for _, calls, seen, _ in rows] != [(n, n) for n in expected]:
        raise RuntimeError(f"all_reduce counts {rows} differ from one per parameter / one per bucket")
    if [ops["allreduce_"] for ops in ddp_ops] != [len(b) for b in ddp_buckets]:
        raise RuntimeError("DDP issued a different number of all_reduces than it has buckets")
    return buckets


def train_side_by_side(rank: int, world: int, device: torch.device, cap_kb: float, batch: int,
                       steps: int, buckets: list[list[int]]) -> None:
    """A few SGD steps with (c) and with DDP from the same start: the parameters must stay equal."""
    comm = Comm()
    ours, ddp = make_model(device), wrap_ddp(device, cap_kb)
    params = list(ours.parameters())
    sync = OverlappedSync(params, buckets, comm, world)
    opt_ours = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:
        print(f"{'step':>4} {'mean loss':>10} {'(c) all_reduces':>16} {'DDP c10d ops':>26} "
              f"{'max |param diff|':>17}")
    worst = 0.0
    for step in range(1, steps + 1):
        x, y = local_batch(rank, step, batch, device)
        comm.calls = 0
        opt_ours.zero_grad()
        sync.start()
        loss = loss_of(ours, x, y)
        loss.backward()
        sync.finish()
        opt_ours.step()
        opt_ddp.zero_grad()
        with C10dOps() as ops:
            loss_of(ddp, x, y).backward()
        opt_ddp.step()
        diff = max_diff(params, list(ddp.parameters()))
        worst = max(worst, diff)
        mean_loss = loss.detach().reshape(1)
        dist.all_reduce(mean_loss)
        if rank == 0:
            seen = ", ".join(f"{n} {op}" for op, n in sorted(ops.ops.items()))
            print(f"{step:>4} {mean_loss.item() / world:>10.4f} {comm.calls:>16} {seen:>26} {diff:>17.1e}")
    check(f"parameters after {steps} SGD steps, (c) vs DDP", worst, rank)


def main(rank: int, world: int, device: torch.device, cap_kb: float, batch: int, steps: int) -> None:
    """Compare the three gradient synchronisations with DDP, then train (c) next to DDP."""
    if rank == 0:
        print(f"== {world} ranks on {device} ({dist.get_backend()}), {LAYERS} Linear layers of width "
              f"{WIDTH}, {2 * LAYERS} parameter tensors, bucket cap {cap_kb:g} KiB\n", flush=True)
    buckets = compare_gradients(rank, world, device, cap_kb, batch)
    if rank == 0:
        print("\n== training: (c) and DDP side by side, SGD with momentum", flush=True)
    train_side_by_side(rank, world, device, cap_kb, batch, steps, buckets)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-cap-kb", type=float, default=2.0, help="bucket cap in KiB (ours and DDP's)")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps of the side-by-side training")
    args = parser.parse_args()
    spawn_world(main, args.world_size, args.bucket_cap_kb, args.batch_size, args.steps)

"""ParallelDims: the parallel degrees of a run, their validation, and the one DeviceMesh built from them."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.config.parallel_options import ParallelOptions
from components.runtime.errors import KilnError
from parallelisms.layout_checks import ModelShape, degree_problems, layout_problems, unusable_degrees

# Outermost to innermost: TP ranks are neighbours (fastest links), PP the farthest apart.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Degrees of every parallel dimension; build_mesh() turns them into named (sub-)meshes.

    Views used by the parallelisms: `dp` (dp_replicate × dp_shard) splits the batch, `dp_shard_cp`
    (dp_shard × cp) is what FSDP shards over, `dp_cp` (dp × cp) averages the loss. EP borrows its
    ranks from dp_shard × cp, as in TorchTitan, so it does not multiply the world size.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    # With expert parallel, a second mesh over the same ranks for expert weights:
    # (pp, dp_replicate, dp_shard_mod_ep, ep, tp), where dp_shard × cp = dp_shard_mod_ep × ep.
    expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        problems = self.resolve()
        if problems:
            raise KilnError(problems[0] if len(problems) == 1 else
                            f"{len(problems)} problems with the parallel degrees: " + "; ".join(problems))

    def resolve(self) -> list[str]:
        """Fill data_parallel_shard_degree -1 with the ranks left over and return every problem of
        the degrees against the world size, one sentence each (layout_checks.degree_problems)."""
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1 and others > 0 and self.world_size % others == 0:
            self.dp_shard = self.world_size // others
        return degree_problems(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep,
                               self.world_size)

    @classmethod
    def unchecked(cls, **degrees: int) -> "ParallelDims":
        """Degrees kept as given, their problems left to check_layout (every problem at once); a
        degree below 1 or an unfillable -1 still raises, since nothing can be checked against it."""
        dims = cls.__new__(cls)
        for name, value in degrees.items():
            setattr(dims, name, value)
        dims.world_mesh, dims.expert_mesh, dims._views = None, None, {}
        dims.resolve()
        unusable = unusable_degrees(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep,
                                    dims.world_size)
        if unusable:
            raise KilnError("; ".join(unusable))
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different samples of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (DDP): replicas but no sharding."""
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def data_parallel_enabled(self) -> bool:
        """Whether fully_shard wraps the model: FSDP, HSDP, or DDP (HSDP with a shard degree of 1)."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    def check_model(self, *, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int,
                    vocab_size: int | None = None) -> None:
        """Reject degrees that cannot split this model's heads, vocabulary, layers or sequence."""
        shape = ModelShape(n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=n_layers,
                           vocab_size=vocab_size)
        self.check_layout(shape, ParallelOptions(seq_len=seq_len))

    def check_layout(self, model: ModelShape, options: ParallelOptions, *, device_type: str = "cpu",
                     global_batch: int | None = None, local_batch: int | None = None,
                     document_mask: bool = False, extra: list[str] | None = None) -> None:
        """Raise one KilnError listing every reason this layout cannot run this model (with `extra`
        problems found by the model's own check); nothing when it can."""
        problems = degree_problems(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep,
                                   self.world_size)
        problems += layout_problems(self, model, options, device_type=device_type, global_batch=global_batch,
                                    local_batch=local_batch, document_mask=document_mask)
        problems += extra or []
        if problems:
            raise KilnError(problems[0] if len(problems) == 1 else
                            f"{len(problems)} problems with this layout: " + "; ".join(problems))

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the world mesh (dims of degree 1 are left out) and its flattened views."""
        if self.world_size == 1:
            return None
        names = [n for n in MESH_ORDER if getattr(self, n) > 1]
        shape = [getattr(self, n) for n in names]
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        self.world_mesh = mesh
        # Flattened views are kept here: torch deprecates slicing them back out of the root.
        # DeviceMesh._flatten is private but torch offers no public way (docs/compatibility.md).
        for view, parts in (
            ("dp", ("dp_replicate", "dp_shard")),
            ("dp_shard_cp", ("dp_shard", "cp")),
            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
        ):
            present = tuple(p for p in parts if p in names)
            if present:
                self._views[view] = mesh[present]._flatten(view) if len(present) > 1 else mesh[present[0]]
        if self.ep > 1:
            # Same rank order as the world mesh: dp_shard × cp (row-major) splits into (rest, ep).
            dims = {"pp": self.pp, "dp_replicate": self.dp_replicate,
                    "dp_shard_mod_ep": self.dp_shard * self.cp // self.ep, "ep": self.ep, "tp": self.tp}
            keep = [n for n, d in dims.items() if d > 1 or n in ("dp_shard_mod_ep", "ep")]
            self.expert_mesh = init_device_mesh(device_type, tuple(dims[n] for n in keep),
                                                mesh_dim_names=tuple(keep))
        return mesh

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named dim or flattened view of the world mesh; None when that dim has degree 1."""
        if self.world_mesh is None:
            return None
        if name in ("ep", "dp_shard_mod_ep"):
            return self.expert_mesh[name] if self.expert_mesh is not None else None
        if name in self._views:
            return self._views[name]
        if name in (self.world_mesh.mesh_dim_names or ()):
            return self.world_mesh[name]
        return None

    def describe(self, options: ParallelOptions, n_stages: int = 1, n_microbatches: int = 0,
                 sequence_parallel: bool | None = None) -> str:
        """The degrees and the layout in words for the start-up summary, e.g.
        "pp 1 × dp_replicate 1 × dp_shard 2 × cp 1 × tp 2 → TP 2 (…) × FSDP2 over 2 ranks";
        sequence_parallel: whether the model's TP plan has it (None: unknown, not said)."""
        if self.world_size == 1:
            mode = "single process"
        elif self.hsdp_enabled:
            mode = f"HSDP: {self.dp_replicate} replicas × FSDP2 over {self.dp_shard * self.cp}"
        elif self.fsdp_enabled:
            mode = f"FSDP2 over {self.dp_shard * self.cp} ranks"
        elif self.ddp_enabled:
            mode = f"DDP over {self.dp_replicate} ranks"
        else:
            mode = "no data parallelism"
        if self.ep > 1:  # borrows its ranks from dp_shard × cp: said beside what it borrows from
            rest = self.dp_shard * self.cp // self.ep
            shard = f", each FSDP-sharded over {rest}" if rest > 1 else ""
            mode = f"{mode}, EP {self.ep} (experts split over {self.ep} ranks{shard})"
        if self.cp > 1:
            mode = f"CP {self.cp} ({options.cp_rotate_method}, head-tail load balanced) × {mode}"
        if self.tp > 1:
            sp = {True: "sequence parallel, ", False: "no sequence parallel, ", None: ""}[sequence_parallel]
            tp = f"TP {self.tp} ({sp}loss parallel {'on' if options.loss_parallel else 'off'})"
            mode = f"{tp} × {mode}" if self.dp * self.cp > 1 else tp
        if self.pp > 1:
            pp = f"PP {self.pp} ({options.pp_schedule}, {n_stages} stages, {n_microbatches} microbatches)"
            mode = pp if mode in ("no data parallelism", "single process") else f"{pp} × {mode}"
        degrees = " × ".join(f"{name} {getattr(self, name)}" for name in MESH_ORDER)
        return f"{degrees} → {mode}"

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh fully_shard runs over: 1-D (dp_shard_cp) for FSDP; with replicas 2-D
        (dp_replicate, dp_shard_cp) — HSDP, or DDP when dp_shard × cp is 1, so that DDP composes
        with TP, PP and CP wherever FSDP does (as torch's FSDP-based `replicate` does)."""
        if not self.data_parallel_enabled or self.world_mesh is None:
            return None
        if self.dp_replicate == 1:
            return self.mesh("dp_shard_cp")
        if "replicate_shard" not in self._views:
            # dp_cp is (dp_replicate, dp_shard, cp) flattened row-major, so unflattening it keeps the
            # world mesh's rank order and root (which TP's DTensors need to compose with it).
            self._views["replicate_shard"] = self.mesh("dp_cp")._unflatten(
                0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp"))
        return self._views["replicate_shard"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards expert weights over: what dp_shard × cp leaves after ep (with HSDP,
        2-D with dp_replicate). It may have size 1: experts then live on one rank each."""
        if self.dp_replicate > 1:
            return self.expert_mesh[("dp_replicate", "dp_shard_mod_ep")]
        return self.expert_mesh["dp_shard_mod_ep"]

    def release(self) -> None:
        """Drop every mesh reference (a live mesh at exit can abort the process: distributed.exit_cleanly)."""
        self._views.clear()
        self.world_mesh = None
        self.expert_mesh = None


"""`ParallelDims`: the sizes of every parallel dimension of a role's ranks and the one `DeviceMesh` they form.

Dimensions (torchtitan's `ParallelDims`, with hyflow's names): `dp_replicate` (HSDP's replicas), `dp_shard` (FSDP2's
shards), `sp` (Ulysses sequence parallelism, verl's `ulysses_sequence_parallel_size`; torchtitan's cp seat), `tp`
(tensor parallelism, `hyflow.models.tensor_parallel`), `pp` (pipeline stages) and `ep` (expert parallelism). The
product pp x dp_replicate x dp_shard x sp x tp is the world size; `ep` borrows its ranks from dp_shard x sp x tp
(as Megatron's expert-data layout with expert_tensor_parallel_size=1 does) and must divide it.

The mesh lays the dimensions out outermost first, in torchtitan's order `pp, dp_replicate, dp_shard, sp, tp`, so the
ranks of a tensor-parallel group are consecutive, then those of a sequence-parallel group: rank = ((((p * R + r) * F
+ f) * S + s) * T + t) (the layout hyflow's separate tensor- and sequence-parallel groups had before this mesh was
their one source). Only the dimensions of size > 1 are in the mesh, and on several ranks `dp_shard` always (FSDP2
shards over it even at size 1, so that tensor-parallel parameters are DTensors of one mesh); besides them it names
the flattened dimensions the engine uses:

- `dp`: dp_replicate x dp_shard, the data-parallel ranks (a batch is split over them);
- `dp_shard_sp`: dp_shard x sp, the ranks FSDP2 shards the parameters over (a sequence-parallel group's ranks hold
  different shards, as verl's Ulysses does);
- `dp_sp`: dp_replicate x dp_shard x sp, the ranks a loss is all-reduced over;
- `sp_tp`: sp x tp, the ranks that compute on the same rows (a sequence x tensor-parallel group).

`build_mesh` returns a `ParallelMesh`: the DeviceMesh and its flattened sub-meshes by name (`get(name)`; None for a
dimension not in the mesh; `group(name)`: None for one of size 1), the mesh FSDP2 shards over (`fsdp_mesh()`:
2-D (dp_replicate, dp_shard x sp) under HSDP) and, at ep > 1, expert parallelism's own (world / ep) x ep mesh
(`expert`, `hyflow.parallel.expert`). One process (every size 1) builds no DeviceMesh and needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

ORDER = ("pp", "dp_replicate", "dp_shard", "sp", "tp")  # outermost first (torchtitan's order, cp -> sp)
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_sp": ("dp_shard", "sp"),
             "dp_sp": ("dp_replicate", "dp_shard", "sp"), "sp_tp": ("sp", "tp")}


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of a role's parallel dimensions over `world_size` ranks; `dp_shard=-1` takes the ranks the others
    leave. Raises ValueError when a size is not positive or the product is not the world size."""

    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        others = {"dp_replicate": self.dp_replicate, "tp": self.tp, "sp": self.sp, "pp": self.pp, "ep": self.ep}
        for name, size in {"world_size": self.world_size, **others}.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelDims: {name}={size!r} must be a positive integer")
        rest = self.pp * self.dp_replicate * self.sp * self.tp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ValueError(f"ParallelDims: pp x dp_replicate x sp x tp = {self.pp} x {self.dp_replicate} x {self.sp} x "
                                 f"{self.tp} must divide the world size {self.world_size}")
            object.__setattr__(self, "dp_shard", self.world_size // rest)
        elif not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"ParallelDims: dp_shard={self.dp_shard!r} must be a positive integer (or -1: the rest)")
        if rest * self.dp_shard != self.world_size:
            raise ValueError(f"ParallelDims: pp x dp_replicate x dp_shard x sp x tp = {self.pp} x {self.dp_replicate} x "
                             f"{self.dp_shard} x {self.sp} x {self.tp} must equal the world size {self.world_size}")
        if (self.dp_shard * self.sp * self.tp) % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} must divide dp_shard x sp x tp = "
                             f"{self.dp_shard * self.sp * self.tp} (expert parallelism borrows those ranks)")

    @property
    def dp_size(self) -> int:
        """The data-parallel size: how many different shares of a batch the ranks compute on."""
        return self.dp_replicate * self.dp_shard

    @property
    def row_group_size(self) -> int:
        """The ranks that compute on the same rows: a sequence-parallel x tensor-parallel group."""
        return self.sp * self.tp

    def sizes(self) -> dict[str, int]:
        """Every mesh dimension of size > 1, outermost first: {name: size}."""
        return {name: getattr(self, name) for name in ORDER if getattr(self, name) > 1}

    def mesh_sizes(self) -> dict[str, int]:
        """The dimensions of the DeviceMesh, outermost first: those of size > 1, and on several ranks `dp_shard`
        always (FSDP2 shards over it, at size 1 too: under tensor parallelism its parameters are 2-D DTensors of
        one mesh); {} on one rank."""
        if self.world_size == 1:
            return {}
        return {name: getattr(self, name) for name in ORDER if getattr(self, name) > 1 or name == "dp_shard"}

    def flattened(self) -> dict[str, tuple[str, ...]]:
        """The flattened dimensions the mesh names (module docstring), each of the mesh dimensions it joins; one of
        a single dimension is that dimension under a second name, one of none is left out."""
        sizes = self.mesh_sizes()
        out = {}
        for name, parts in FLATTENED.items():
            present = tuple(part for part in parts if part in sizes)
            if present:
                out[name] = present
        return out

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """The one DeviceMesh of these dimensions, with its flattened sub-meshes (module docstring); every rank
        calls it, in the same order (it creates the process groups). One process gets a `ParallelMesh` without a
        DeviceMesh, whose every sub-mesh is None: nothing is created, no process group is needed."""
        if self.world_size == 1:
            return ParallelMesh(self, None, {})
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.mesh_sizes()
        root = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        # a flattened name of one dimension is that dimension's own sub-mesh (no new process group)
        flat = {name: root[parts]._flatten(name) if len(parts) > 1 else root[parts[0]]
                for name, parts in self.flattened().items()}
        if self.dp_replicate > 1:  # HSDP: FSDP2 replicates over dp_replicate and shards over dp_shard x sp
            flat["hsdp"] = self._hsdp_mesh(root)
        return ParallelMesh(self, root, flat, self._expert_layout(device_type, root))

    def _hsdp_mesh(self, root):
        """The 2-D (dp_replicate, dp_shard x sp) mesh FSDP2 takes for hybrid sharding."""
        if self.sp == 1:
            return root["dp_replicate", "dp_shard"]
        import warnings

        with warnings.catch_warnings():  # torch 2.13 still slices a flattened dimension from the root, and warns
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return root["dp_replicate", "dp_shard_sp"]

    def _expert_layout(self, device_type: str, root=None):
        """Expert parallelism's mesh and groups (`hyflow.parallel.expert.ExpertLayout`), None at ep=1: a pipeline
        stage's ranks (all of them at pp=1) as (stage ranks / ep) x ep, so each ep group is a run of ep consecutive
        ranks of one replica's dp_shard x sp x tp ranks, and the `edp` groups join the ranks of the stage that hold
        the same experts (another stage holds other layers' experts); the tensor-parallel group (whose ranks share
        their tokens and split the (token, choice) pairs between them)."""
        if self.ep == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        from hyflow.parallel.expert import ExpertLayout

        stage_ranks = self.world_size // self.pp
        if self.pp == 1:
            mesh = init_device_mesh(device_type, (stage_ranks // self.ep, self.ep), mesh_dim_names=("edp", "ep"))
        else:  # pp outermost: each stage's (edp, ep) sub-mesh
            staged = init_device_mesh(device_type, (self.pp, stage_ranks // self.ep, self.ep),
                                      mesh_dim_names=("pp", "edp", "ep"))
            mesh = staged["edp", "ep"]
        edp = mesh["edp"].get_group() if stage_ranks > self.ep else None
        tp_group = root["tp"].get_group() if self.tp > 1 else None
        return ExpertLayout(mesh=mesh, ep_group=mesh["ep"].get_group(), ep_size=self.ep, edp_group=edp,
                            grad_divisor=self.dp_replicate * self.dp_shard * self.sp, tp_group=tp_group,
                            tp_size=self.tp)


@dataclass(frozen=True)
class ParallelMesh:
    """The DeviceMesh `root` of `dims` (None for one process) and its flattened sub-meshes `flat` ({name: mesh},
    kept here: torch deprecates slicing them from the root again)."""

    dims: ParallelDims
    root: object
    flat: dict
    expert: object = None  # hyflow.parallel.expert.ExpertLayout when ep > 1

    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: `dp_shard_sp`, or under HSDP (dp_replicate > 1) the 2-D (dp_replicate,
        dp_shard x sp) mesh (replicated over the first, sharded over the second); None for one process."""
        hsdp = self.flat.get("hsdp")
        return hsdp if hsdp is not None else self.get("dp_shard_sp")

    def get(self, name: str):
        """The sub-mesh `name` (a mesh dimension of `ORDER` or a flattened one of `FLATTENED`), or None when it is
        not in the mesh (size 1, `mesh_sizes`) or there is no mesh (one process). Raises KeyError for another name."""
        if name not in ORDER and name not in FLATTENED:
            raise KeyError(f"no mesh dimension {name!r}; the dimensions are {ORDER + tuple(FLATTENED)}")
        if self.root is None:
            return None
        if name in self.flat:
            return self.flat[name]
        return self.root[name] if name in self.dims.mesh_sizes() else None

    def local_rank(self, name: str) -> int:
        """This rank's index along dimension `name` (0 when it has size 1)."""
        mesh = self.get(name)
        return 0 if mesh is None else mesh.get_local_rank()

    def group(self, name: str):
        """The process group of this rank along `name`, or None when the dimension has size 1."""
        mesh = self.get(name)
        return None if mesh is None or mesh.size() == 1 else mesh.get_group()

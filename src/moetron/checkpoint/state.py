"""What goes into a checkpoint and back: model and optimizer state as layout-free global tensors (DCP).

The model and optimizer are saved with `torch.distributed.checkpoint` (DCP): each rank writes only what it
holds, each tensor under its global name and global shape, and a reader of any other layout reads back just its
own slices (DCP plans the resharding). Keys:

    model.<parameter or buffer name>               e.g. model.layers.1.mlp.experts.w1_EDF  [E, D, F]
    optim.<parameter name>.<state key>             every optimizer state tensor (exp_avg, exp_avg_sq, step, …)

Layout-free by construction: names never change with the layout (layers keyed by global index), routed experts
are one global `[E, …]` tensor whose row e is global expert e (this rank's `[E/ep, …]` slice is written as a
DTensor shard over the expert-parallel mesh; replicas over expert-data parallelism are written once), tensor-parallel
shards (plain local tensors the registry marks as split) are written as DTensor shards of their global tensor,
DTensor parameters (ZeRO) are already global, and plain replicated tensors are written by one rank
(DCP de-duplicates them). So a checkpoint saved at any (dp, ep) layout loads at any other, optimizer state
included, and no rank ever holds more than its own shards plus one tensor in flight. Optimizer state is generic:
whatever tensors the optimizer keeps per parameter, those with the parameter's shape are laid out like it.

Per-rank RNG states (`rng/`), the trainer state (`state.json`) and the config travel beside DCP's files
(see `files.py` for the directory layout and the atomic publish).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moetron.checkpoint import files
from moetron.checkpoint.integrity import files_written_by, record_checksums, verify_checkpoint
from moetron.checkpoint.rng_files import load_rng, rng_tensors
from moetron.errors import SaidByAnotherRank, UserError
from moetron.fileio import describe_os_error
from moetron.parallel.diagnosis import Site, failure_kind
from moetron.parallel.mesh import ParallelMesh
from moetron.parallel.params import ParamInfo, ParamRegistry


# ---------------------------------------------------------------------------- layout-free views
class GlobalView:
    """Maps this rank's tensors to their layout-free global form (and back, in place, for loading)."""

    def __init__(
        self,
        model: nn.Module,
        registry: ParamRegistry,
        mesh: ParallelMesh | None,
        optimizer_params: list[tuple[str, torch.Tensor]] | None = None,
    ):
        """`optimizer_params`: (name, tensor) the optimizer steps, when not the model's parameters (ZeRO-1)."""
        self.model, self.registry, self.mesh = model, registry, mesh
        self.expert_mesh = mesh.submesh("edp", "ep") if mesh is not None and mesh.size("ep") > 1 else None
        self.optimizer_params = optimizer_params

    def tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """`local` (a tensor of parameter `name`'s shape, or the parameter itself) as its global tensor."""
        info = self.registry.infos.get(name)
        local = local.detach()
        if info is not None and info.tp_dim is not None and self.mesh is not None:
            return self.tensor_parallel_shard(info, local)
        if info is None or not info.is_expert or self.expert_mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if isinstance(local, DTensor) and local.device_mesh.mesh_dim_names == ("edp",):
            return self.sharded_experts(info, local)
        shape = (info.num_global_experts, *local.shape[1:])
        return DTensor.from_local(
            local, self.expert_mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=_stride(shape)
        )

    def sharded_experts(self, info, shard) -> torch.Tensor:
        """ZeRO: an expert stack sharded over edp (FSDP2, or the stage-1 optimizer shards: `Shard(d)` of the LOCAL
        `[E/ep, …]` stack) as the global `[E, …]` tensor over (edp, ep). Rows are split by ep first, then each
        block by edp: on dim 0 that order is `_StridedShard(0, split_factor=ep)` (FSDP2 + TP's placement)."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        (placement,) = shard.placements
        dim = placement.dim
        over_edp = _StridedShard(0, split_factor=self.expert_mesh.size(1)) if dim == 0 else Shard(dim)
        shape = (info.num_global_experts, *shard.shape[1:])
        return DTensor.from_local(
            shard.to_local(),
            self.expert_mesh,
            [over_edp, Shard(0)],
            run_check=False,
            shape=shape,
            stride=_stride(shape),
        )

    def tensor_parallel_shard(self, info: ParamInfo, local: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel shard (split on `info.tp_dim`) as its global DTensor: dense parameters over the
        (dp, tp) mesh, replicated over dp; experts split by expert TP over (edp, ep, etp), experts on dim 0. The
        global shape is the config's (the padded vocabulary does not depend on TP), so any TP size reads it.

        Under ZeRO the shard is itself a DTensor `Shard(d)` over dp_cp (edp for experts) of the TP-local tensor: its
        placement on that mesh dimension becomes `Shard(d)`, or `_StridedShard(d, split_factor)` when the later mesh
        dimensions split d too (TP, EP split first, then ZeRO each of their blocks: FSDP2 + TP's placement)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = list(local.shape)
        shape[info.tp_dim] *= self.mesh.size("tp")
        if info.is_expert:
            shape[0] = info.num_global_experts
            names, placements = ("edp", "ep", "etp"), [Replicate(), Shard(0), Shard(info.tp_dim)]
        else:
            # a ZeRO shard is over the dense gradients' replicas: dp × cp under context parallelism (dp without)
            names = ("dp_cp" if isinstance(local, DTensor) else "dp", "tp")
            placements = [Replicate(), Shard(info.tp_dim)]
        if isinstance(local, DTensor):
            placements[0] = _zero_placement(local, names, placements[1:], self.mesh)
            local = local.to_local()
        shape = tuple(shape)
        mesh = self.mesh.submesh(*names)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=_stride(shape))

    def model_state(self) -> dict[str, torch.Tensor]:
        """`model.<name>` → global tensor, for every parameter and persistent buffer."""
        return {f"model.{name}": self.tensor(name, t) for name, t in self.model.state_dict().items()}

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """What a trainer checkpoint holds: `model_state` and `optimizer_state` in one dict."""
        return {**self.model_state(), **self.optimizer_state(optimizer)}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """`optim.<parameter>.<key>` → global tensor, for every tensor the optimizer keeps per parameter."""
        named = self.model.named_parameters() if self.optimizer_params is None else self.optimizer_params
        names = {id(p): n for n, p in named}
        out = {}
        for param, state in optimizer.state.items():
            name = names[id(param)]
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
                same_layout = value.shape == param.shape
                out[f"optim.{name}.{key}"] = self.tensor(name, value) if same_layout else value.detach()
        return out


def _zero_placement(shard, names: tuple[str, ...], later: list, mesh: ParallelMesh):
    """The placement over dp / edp (`names[0]`) of a ZeRO shard of a TP-local tensor whose `later` placements
    (over `names[1:]`) split the tensor first."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    (placement,) = shard.placements
    dim = placement.dim
    split = math.prod(mesh.size(n) for n, p in zip(names[1:], later, strict=True) if p.is_shard(dim))
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (so there is something to load into): one step with zero
    gradients at learning rate 0 changes no parameter; the loaded values then replace the state it made."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- entry points
def save_checkpoint(
    run_dir,
    iteration: int,
    view: GlobalView,
    optimizer: torch.optim.Optimizer,
    state: dict,
    config_yaml: str,
    env,
    keep_last_n: int,
) -> Path:
    """Every rank calls this; each writes its shards and its RNG, rank 0 the shared files. Returns the path.

    A write that fails on any rank (a full disk, a vanished mount) fails the save on every rank with one line:
    the staging directory is removed, `latest` still names the previous checkpoint, which stays intact."""
    run_dir = Path(run_dir)
    small = SmallFiles(rng_tensors(), state, config_yaml)

    def write_tensors(tmp: Path) -> None:
        with single_process_quiet():
            write_dcp_files(tmp, view.state(optimizer), shared_files=env.is_main)

    write_then_publish(env, run_dir, iteration, keep_last_n, small, write_tensors)
    return run_dir / files.iteration_dir_name(iteration)


@dataclass(frozen=True)
class SmallFiles:
    """What a save writes beside DCP's files, captured at the step saved: this rank's RNG states and (rank 0)
    state.json's trainer state and config.yaml."""

    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    state: dict
    config_yaml: str

    def write(self, tmp: Path, env) -> None:
        files.write_tensors(tmp / "rng" / f"rank_{env.rank:05d}.safetensors", *self.rng)
        if env.is_main:
            write_shared_files(tmp, self.state, self.config_yaml)


def write_then_publish(
    env,
    run_dir: Path,
    iteration: int,
    keep_last_n: int,
    small: SmallFiles,
    write_tensors: Callable[[Path], None],
    writer_thread: WriterThread | None = None,
) -> None:
    """The phases of every trainer save, synchronous (`save_checkpoint`) or in a writer thread (`async_save.py`), in
    this order, each agreed by every rank so that a failure anywhere fails the save everywhere with one line and the
    previous checkpoint stays `latest`: rank 0 makes a fresh staging directory (the agreement is the barrier before
    any rank writes into it); every rank writes its `SmallFiles`, then `write_tensors(staging dir)` (DCP's files of
    its tensors and their checksums); rank 0 publishes (rename to iter_*, then `latest`, then prune)."""
    tmp, thread = files.staging_dir(run_dir, iteration), writer_thread or WriterThread()
    with thread.site(f"the checkpoint barrier of the save of iteration {iteration}"):
        failure = _attempt(lambda: files.prepare_staging(run_dir, iteration)) if env.is_main else None
        _fail_everywhere_if_any(env, failure, run_dir, iteration, group=thread.group)
    with thread.site(f"the checkpoint save of iteration {iteration} (DCP's collectives)"):
        failure = _attempt(lambda: small.write(tmp, env)) or thread.attempt(lambda: write_tensors(tmp))
        _fail_everywhere_if_any(env, failure, run_dir, iteration, discard=tmp, group=thread.group)
        failure = _attempt(lambda: files.publish(run_dir, iteration, keep_last_n)) if env.is_main else None
        _fail_everywhere_if_any(env, failure, run_dir, iteration, group=thread.group)


@dataclass(frozen=True)
class WriterThread:
    """Where `write_then_publish` runs: the training loop's thread (the default: the world's collectives, each phase a
    `Site` of the hang diagnosis), or the asynchronous save's writer thread (its own gloo `group`, no `Site`, which
    belongs to the loop's thread, and every error of the tensor phase caught: a failed staging copy is no OSError)."""

    group: object = None
    in_background: bool = False

    def site(self, what: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.in_background else Site(what)

    def attempt(self, write: Callable[[], None]) -> BaseException | None:
        return _attempt_any(write) if self.in_background else _attempt(write)


def write_dcp_files(tmp: Path, tensors: dict[str, torch.Tensor], shared_files: bool, group=None) -> None:
    """Into the staging directory `tmp`: DCP's files of `tensors` (this process's part, over `group`: the world's by
    default), then the checksums of every file this process wrote there (`shared_files`: state.json, config.yaml)."""
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), process_group=group,
             no_dist=no_dist)  # fmt: skip
    rank = 0 if no_dist else dist.get_rank(group)  # DCP names this process's shards by it
    record_checksums(tmp, rank, files_written_by(tmp, rank, shared_files))


def write_shared_files(tmp: Path, state: dict, config_yaml: str) -> None:
    """(one process of the save) state.json and config.yaml into the staging directory `tmp`, fsynced."""
    files.write_json(tmp / "state.json", {"format_version": files.FORMAT_VERSION, **state})
    (tmp / "config.yaml").write_text(config_yaml)
    files._fsync_file(tmp / "config.yaml")


def _attempt(write) -> BaseException | None:
    """Run `write`; the OS or DCP error it raised (None when it worked)."""
    try:
        write()
    except (OSError, CheckpointException) as err:
        return err
    return None


def _attempt_any(write) -> BaseException | None:
    """`_attempt` for the background write: any error of DCP's staging copy or write (a failed copy raises no
    OSError) is this rank's failure to agree on, so no peer is left waiting in the agreement."""
    try:
        write()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException; said by `wait`
        return err
    return None


def _fail_everywhere_if_any(
    env, failure: BaseException | None, run_dir: Path, iteration: int, discard=None, group=None
) -> None:
    """Agree on every rank whether the phase failed anywhere; if so, clean up and raise the same kind of line.
    `group`: a gloo group to agree over instead of the world's (the asynchronous save's writer thread)."""
    failed = failure is not None
    if env.distributed:
        flag = torch.tensor([float(failed)], device=env.device if group is None else "cpu")
        if group is None:
            env.all_reduce_(flag, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())  # a host read, once per checkpoint save
    if not failed:
        return
    if discard is not None and env.is_main:
        shutil.rmtree(discard, ignore_errors=True)
    previous = files.read_latest(run_dir) if (run_dir / files.LATEST).is_file() else None
    kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
    why = _save_error(failure, run_dir) if failure is not None else "it failed on another rank"
    raise UserError(f"saving the checkpoint of iteration {iteration} in {run_dir} failed ({why}); {kept}")


def _save_error(err: BaseException, run_dir: Path) -> str:
    if isinstance(err, CheckpointException) and err.failures:
        first = next(iter(err.failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    if isinstance(err, OSError):
        return describe_os_error(err, run_dir)
    return _first_line(err)


def check_format(path: Path) -> dict:
    """state.json of a checkpoint in this version's format (a one-line error for moetron 0.1's or garbage)."""
    state = files.read_json(path / "state.json")
    version = state.get("format_version")
    if version == 1:
        raise UserError(
            f"checkpoint {path} was written by moetron 0.1 (checkpoint format 1); convert it once with "
            f"`moetron convert-checkpoint --load {path} --save NEW_DIR`, then --load NEW_DIR"
        )
    if version != files.FORMAT_VERSION:
        raise files.corrupt(path, f"unknown format_version {version!r}")
    if not (path / ".metadata").is_file():
        raise files.corrupt(path, "missing .metadata (the model and optimizer tensors)")
    return state


def load_checkpoint(
    path: Path,
    view: GlobalView,
    optimizer: torch.optim.Optimizer | None = None,
    load_rng: bool = True,
    rank: int = 0,
    env=None,
) -> dict:
    """Restore into the view's model (and `optimizer`, this rank's RNG when asked); returns the trainer state.
    Every file is first checked against its recorded checksum: by this process alone, or with `env` (the run's
    DistEnv) each rank its share, all agreeing (`integrity.py`)."""
    state = check_format(path)
    verify_shared(path, env)
    tensors = view.model_state()
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
        tensors.update(view.optimizer_state(optimizer))
    with Site(f"the checkpoint load of {path.name} (DCP's collectives)"):
        _read(path, tensors)
    if load_rng:
        load_rng_file(path, rank)
    return state


def verify_shared(path: Path, env=None) -> None:
    """`verify_checkpoint` of `path`, spread over the ranks of `env` when distributed: each hashes its share, and a
    mismatch anywhere stops every rank — the one that found it says which file, the others stop quietly."""
    if env is None or not env.distributed:
        verify_checkpoint(path)
        return
    problem = None
    try:
        verify_checkpoint(path, part=(env.rank, env.world_size))
    except UserError as err:
        problem = err
    flag = torch.tensor([float(problem is not None)], device=env.device)
    failed = bool(env.all_reduce_(flag, op=dist.ReduceOp.MAX).item())  # a host read, once per load
    if problem is not None:
        raise problem
    if failed:
        raise SaidByAnotherRank(f"checkpoint {path}: another rank found a file that does not match its checksum")


def _check_against_metadata(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every requested tensor is in the checkpoint with the same global shape, else one line saying which."""
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # noqa: BLE001 - a truncated or foreign .metadata file
        raise files.corrupt(path, f".metadata: {_first_line(err)}") from None
    wanted_optim = [k for k in tensors if k.startswith("optim.")]
    if wanted_optim and not any(k in saved for k in wanted_optim):
        raise UserError(
            f"checkpoint {path} holds no optimizer state; add --no-load-optim (or --finetune) to start the "
            f"optimizer fresh"
        )
    for key, tensor in tensors.items():
        if key not in saved and key.startswith("optim."):  # e.g. Muon's momentum_buffer where AdamW kept exp_avg
            raise UserError(
                f"checkpoint {path} holds no {key}: it was saved with another --optimizer (see its config.yaml); "
                f"resume with that --optimizer, or add --no-load-optim to start this optimizer fresh"
            )
        if key not in saved:
            raise files.corrupt(path, f"it lacks {key}; saved from another model? (see its config.yaml)")
        shape = tuple(getattr(saved[key], "size", ()))
        if shape != tuple(tensor.shape):
            raise UserError(
                f"checkpoint {path}: {key} has shape {shape}, the model expects {tuple(tensor.shape)}; the model "
                f"flags differ from the run that saved it (see its config.yaml)"
            )


def _read(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """DCP load in place, with its failures as one line (a checkpoint of another model, a truncated file)."""
    _check_against_metadata(path, tensors)
    try:
        with single_process_quiet() as no_dist:
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps every rank's failure: one line
        if failure_kind(err) is not None:  # a peer stalled or died: not the checkpoint's fault
            raise
        raise files.corrupt(path, _first_line(err)) from None


@contextlib.contextmanager
def single_process_quiet():
    """Yields DCP's `no_dist` for this process; in one process, without DCP's warning that it assumes so."""
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield no_dist


def _first_line(err: BaseException) -> str:
    if isinstance(err, CheckpointException) and err.failures:  # {rank: (exception, traceback)}
        first = next(iter(err.failures.values()))
        err = first[0] if isinstance(first, tuple) else first
        if isinstance(err, BaseException) and not str(err):
            return type(err).__name__
    text = str(err).strip()
    for line in text.splitlines():
        if "Missing key" in line or "missing" in line.lower() or "size" in line.lower():
            return line.strip()[:300]
    return (text.splitlines() or [type(err).__name__])[0][:300]


def load_rng_file(path: Path, rank: int) -> None:
    """This rank's generator states. A checkpoint saved by fewer processes has none for the ranks beyond them (the
    run continues from the seed there, and says so); one missing among those the saving run wrote is refused."""
    rng_file = path / "rng" / f"rank_{rank:05d}.safetensors"
    if rng_file.is_file():
        load_rng(rng_file)
        return
    # every process of a trainer's save writes a DCP shard file `__{rank}_{n}.distcp` and its RNG file; a converter's
    # checkpoint (`import`, `upcycle`) has no RNG file at all: nothing is missing there
    rng_ranks = [int(p.stem.removeprefix("rank_")) for p in (path / "rng").glob("rank_*.safetensors")]
    if not rng_ranks:
        print(f"warning: {path} holds no RNG states (written by a converter); rank {rank}'s RNG starts from the seed")
        return
    savers = 1 + max(rng_ranks + [int(p.name.split("_")[2]) for p in path.glob("__*_*.distcp")])
    if rank < savers:
        raise files.corrupt(path, f"missing rng/{rng_file.name}, which rank {rank} of the {savers} processes that "
                            "saved it wrote; add --no-load-rng to continue from the seed instead")  # fmt: skip
    print(f"warning: {rng_file} not found (the checkpoint was saved by {savers} process(es)); rank {rank}'s RNG "
          "continues from the seed")  # fmt: skip


def load_weights(path: Path, model: nn.Module, mesh: ParallelMesh | None = None) -> dict:
    """Only the weights: into a whole model in this process (every expert, whatever layout saved them), or into
    this rank's part of one at `mesh`'s layout. Returns the trainer state of state.json."""
    return load_checkpoint(path, GlobalView(model, ParamRegistry.from_model(model), mesh), None, load_rng=False)


def write_checkpoint(
    run_dir,
    iteration: int,
    model_tensors: dict[str, torch.Tensor],
    state: dict,
    config_yaml: str,
    optim_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """One process: a new checkpoint in `run_dir` from parameter name → global tensor (and, when given,
    `<parameter>.<state key>` → optimizer state tensor), published atomically like the trainer's.

    For converters (`moetron import`, `moetron upcycle`): the keys are the trainer's (`model.<name>`,
    `optim.<name>.<key>`), so `moetron train --load run_dir` reads it at any layout."""
    run_dir = Path(run_dir)
    files.prepare_staging(run_dir, iteration)
    tmp = files.staging_dir(run_dir, iteration)
    tensors = {f"model.{name}": t.detach().contiguous() for name, t in model_tensors.items()}
    tensors.update({f"optim.{name}": t.detach().contiguous() for name, t in (optim_tensors or {}).items()})
    write_shared_files(tmp, state, config_yaml)
    with single_process_quiet():
        write_dcp_files(tmp, tensors, shared_files=True)
    return files.publish(run_dir, iteration, keep_last_n=1)

"""Functions that run on every rank of a test's gloo group (module level, so ranks can import them)."""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def keep_warnings() -> tuple[list[str], logging.Handler]:
    """The warning lines ckpttool logs from now on, in a list, and the handler that keeps them
    (remove it from the "ckpttool" logger when done)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("ckpttool").addHandler(handler)
    return records, handler


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective), or the tensor itself."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, object]:
    """Every parameter, buffer and optimizer state tensor in full, keyed by name; same on every rank."""
    out: dict[str, object] = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    if optimizer is not None:
        out.update(optimizer_state(model, optimizer, "optim"))
    return out


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, object]:
    """An optimizer's state in full keyed ``prefix.<parameter name>.<state key>``, and its groups'
    settings keyed ``prefix.group<i>.<setting>`` (a collective: the same on every rank)."""
    out: dict[str, object] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"{prefix}.{names[id(p)]}.{k}"] = full(v) if isinstance(v, torch.Tensor) else v
    for i, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"{prefix}.group{i}.{k}"] = v
    return out


def trainer_args(**overrides) -> argparse.Namespace:
    from ckpttool.training.trainer.train import make_parser

    args = make_parser().parse_args(["--steps", str(overrides.get("steps", 1))])
    for k, v in overrides.items():
        setattr(args, k.replace("-", "_"), v)
    return args


def train_run(**overrides) -> dict[str, object]:
    """Run the real trainer in this group; return its losses and the final full state."""
    from ckpttool.training.trainer.train import run_training

    run = run_training(trainer_args(**overrides))
    return {"losses": run.losses, "start": run.start_step, "state": full_state(run.model, run.optimizer), "lrs": run.lrs}


def fresh_model(seed: int = 123, model_size: str = "tiny", mesh_shape: tuple[int, ...] | None = None, config=None):
    """The trainer's model under FSDP2 on all ranks (1-D), or HSDP on a 2-D (replicate, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from ckpttool.training.trainer.model import PRESETS, build_fsdp_model

    shape = mesh_shape or (dist.get_world_size(),)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = build_fsdp_model(config or PRESETS[model_size], mesh, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, optimizer


def initial_state(seed: int = 0) -> dict[str, object]:
    model, _ = fresh_model(seed=seed)
    return full_state(model, None)


def load_into_fresh(root: str, step: int | None = None, with_optimizer: bool = True) -> dict[str, object]:
    """A model built with another seed (so every value differs) loaded from ``root``."""
    from ckpttool import Checkpointer

    model, optimizer = fresh_model(seed=999)
    res = Checkpointer(root).load(model, optimizer if with_optimizer else None, step=step)
    return {"step": res.step, "extra": res.extra, "state": full_state(model, optimizer if with_optimizer else None)}


def plain_dcp_load(path: str) -> dict[str, object]:
    """Load a checkpoint with plain torch.distributed.checkpoint (no ckpttool code)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = fresh_model(seed=999)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"state": full_state(model, optimizer)}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so -0.0 != 0.0 and NaN == NaN as stored."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, f"{what}: {k}: {x} vs {y}"
            assert torch.equal(bits(x), bits(y)), f"{what}: {k} differs"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


# --- a model saved with plain torch only (no ckpttool code on the save path) ---------------------


class OddNet(torch.nn.Module):
    """Shapes that break naive resharding: dim 0 not divisible by 2, 3 or 4, fewer rows than ranks,
    a bf16 submodule, an integer buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.lin = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3, bias=False).to(torch.bfloat16)
        self.register_buffer("counts", torch.arange(7))

    def forward(self, x):
        return self.head(torch.relu(self.lin(self.emb(x))).to(torch.bfloat16)).float()


def oddnet_sharded(mesh_shape: tuple[int, ...] | None = None):
    """OddNet under FSDP2 on a 1-D mesh of all ranks, or HSDP on a 2-D ``(replicate, shard)`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full weights on every rank, at every world size
    model = OddNet()
    shape = mesh_shape or (dist.get_world_size(),)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    fully_shard(model.lin, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def plain_torch_save(path: str) -> dict[str, object]:
    """Train one step and save with plain dcp.save; return the full state torch.save would hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer = oddnet_sharded()
    x = torch.arange(12).reshape(4, 3) % 13
    model(x).sum().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    extra = {"step": 1, "tag": "plain", "betas_seen": (0.9, 0.999)}
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=path)
    fmsd, fosd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": fmsd, "optim": fosd, "extra": extra}


def plain_torch_load(path: str, mesh_shape: tuple[int, ...] | None = None) -> dict[str, object]:
    """Plain dcp.load into a fresh sharded OddNet + AdamW; return the full state afterwards, and
    which files each rank read (bytes per file and the keys it read from each)."""
    from torch.distributed.checkpoint import FileSystemReader

    reads: dict[str, dict] = {}

    class CountingReader(FileSystemReader):
        """torch's own reader; records which file each read item is served from."""

        def read_data(self, plan, planner):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                entry = reads.setdefault(info.relative_path, {"bytes": 0, "keys": set()})
                entry["bytes"] += info.length
                entry["keys"].add(item.storage_index.fqn)
            return super().read_data(plan, planner)

    model, optimizer = oddnet_sharded(mesh_shape)
    out = load_zeroed(model, optimizer, storage_reader=CountingReader(path))
    return {**out, "reads": reads, "rank": dist.get_rank()}


def load_zeroed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **load_args) -> dict[str, object]:
    """Zero the model, plain ``dcp.load(state, **load_args)`` into its model and optimizer state,
    and return the full state afterwards (what torch.save would hold)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, **load_args)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fmsd, fosd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": fmsd, "optim": fosd}


def load_and_verify(root: str, mesh_shape: tuple[int, ...] | None = None, flip: tuple[str, int] | None = None) -> dict[str, object]:
    """Load the newest step onto a 1-D or HSDP mesh, then verify_loaded; with ``flip`` (file, byte)
    rank 0 flips a bit of the checkpoint after the load, so the check must fail on every rank."""
    import os

    from ckpttool import Checkpointer, verify_loaded

    model, optimizer = fresh_model(seed=999, mesh_shape=mesh_shape)
    res = Checkpointer(root).load(model, optimizer)
    if flip is not None:
        if dist.get_rank() == 0:
            with open(os.path.join(res.path, flip[0]), "r+b") as f:
                f.seek(flip[1])
                b = f.read(1)[0]
                f.seek(flip[1])
                f.write(bytes([b ^ 0x10]))
        dist.barrier()
    report = verify_loaded(model, optimizer, res.path)
    return {"state": full_state(model, optimizer), "ok": report.ok, "tensors": report.tensors_checked,
            "mismatches": [(m.key, m.rank, m.first_index) for m in report.mismatches]}


def load_wrong_shape(root: str) -> str:
    from dataclasses import replace

    from ckpttool import Checkpointer
    from ckpttool.errors import MismatchError
    from ckpttool.training.trainer.model import PRESETS

    model, optimizer = fresh_model(config=replace(PRESETS["tiny"], vocab_size=70))
    try:
        Checkpointer(root).load(model, optimizer)
    except MismatchError as exc:
        return str(exc)
    return "no error"


def load_and_report(root: str, verify: bool = True, mesh_shape: tuple[int, ...] | None = None) -> dict[str, object]:
    """Load the newest step; return the typed error's type and message instead of raising."""
    from ckpttool import Checkpointer
    from ckpttool.errors import CkptError

    model, optimizer = fresh_model(seed=999, mesh_shape=mesh_shape)
    try:
        res = Checkpointer(root).load(model, optimizer, verify=verify)
    except CkptError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    except RuntimeError as exc:  # another rank's error, as every rank agrees on failure
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "step": res.step}


# --- async save, failures and crashes --------------------------------------------------------------


def _train_steps(model, optimizer, start: int, n: int) -> None:
    from ckpttool.training.trainer.model import PRESETS, local_batch

    for step in range(start, start + n):
        x, y = local_batch(step, dist.get_rank(), dist.get_world_size(), 12, PRESETS["tiny"], 0)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def async_snapshot(root: str) -> dict[str, object]:
    """Async save at step 2 and keep training at once (FSDP collectives run beside the background
    copy and write; the optimizer's next step waits for the copy, the documented fence); what was
    written must be step 2's state. Parameters are changed only through the optimizer here: an
    in-place edit outside it before that step races the copy (documented: ``wait()`` first)."""
    from ckpttool import Checkpointer

    model, optimizer = fresh_model(seed=0)
    _train_steps(model, optimizer, 0, 2)
    expected = full_state(model, optimizer)
    ckpt = Checkpointer(root, async_save=True)
    ckpt.save(2, model, optimizer, extra={"step": 2})
    _train_steps(model, optimizer, 2, 3)
    ckpt.save(5, model, optimizer, extra={"step": 5})  # waits for step 2 first
    after = full_state(model, optimizer)
    ckpt.close()
    fresh, fopt = fresh_model(seed=5)
    res = Checkpointer(root).load(fresh, fopt, step=2)
    loaded2 = full_state(fresh, fopt)
    Checkpointer(root).load(fresh, fopt, step=5)
    return {"expected": expected, "loaded2": loaded2, "after": after, "loaded5": full_state(fresh, fopt),
            "extra": res.extra, "steps": Checkpointer(root).steps()}


def async_write_error(root: str) -> dict[str, object]:
    """A background write that fails (file size limit: 'disk full') surfaces at the next call."""
    import resource
    import signal

    from ckpttool import Checkpointer
    from ckpttool.errors import CkptError

    model, optimizer = fresh_model(seed=0)
    ckpt = Checkpointer(root, async_save=True)
    ckpt.save(1, model, optimizer)
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
    returned = False
    try:
        ckpt.save(2, model, optimizer)
        returned = True
        _train_steps(model, optimizer, 0, 1)
        ckpt.wait()
        message = "no error"
    except CkptError as exc:
        message = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ckpt.close()
    return {"returned": returned, "message": message, "steps": Checkpointer(root).steps()}


def crash_during_save(root: str, expected_path: str, async_save: bool, model_size: str = "tiny") -> None:
    """Save step 2 normally and record it, then save step 4 with CKPTTOOL_PAUSE_AT set: the test
    kills every rank with SIGKILL while they are paused inside the save."""
    import os

    from ckpttool import Checkpointer

    pause = os.environ.pop("CKPTTOOL_PAUSE_AT")
    model, optimizer = fresh_model(seed=0, model_size=model_size)
    ckpt = Checkpointer(root, async_save=async_save)
    _train_steps(model, optimizer, 0, 2)
    ckpt.save(2, model, optimizer, extra={"step": 2})
    ckpt.wait()
    state = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(state, expected_path)
    dist.barrier()
    _train_steps(model, optimizer, 2, 2)
    os.environ["CKPTTOOL_PAUSE_AT"] = pause
    ckpt.save(4, model, optimizer, extra={"step": 4})
    _train_steps(model, optimizer, 4, 1)
    ckpt.wait()
    while True:  # ranks that do not pause (after-write pauses every rank) wait to be killed
        import time

        time.sleep(1)


def oddnet_ckpt_save(root: str) -> dict[str, object]:
    """OddNet (bf16 module, int buffer, 3-row weight) trained a step and saved through ckpttool."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpttool import Checkpointer

    model, optimizer = oddnet_sharded()
    model(torch.arange(12).reshape(4, 3) % 13).sum().backward()
    optimizer.step()
    Checkpointer(root).save(1, model, optimizer, extra={"k": (1, 2)})
    fmsd, fosd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": fmsd, "optim": fosd}


def oddnet_ckpt_load(root: str, mesh_shape: tuple[int, ...] | None = None) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from ckpttool import Checkpointer, verify_loaded

    model, optimizer = oddnet_sharded(mesh_shape)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.counts.zero_()
    res = Checkpointer(root).load(model, optimizer)
    report = verify_loaded(model, optimizer, res.path)
    fmsd, fosd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": fmsd, "optim": fosd, "ok": report.ok, "extra": res.extra}


def compressed_save(root: str, async_save: bool) -> dict[str, object]:
    """The trainer's model trained a step, saved by a Checkpointer that compresses every record."""
    from ckpttool import Checkpointer

    model, optimizer = fresh_model(seed=7)
    _train_steps(model, optimizer, 0, 1)
    with Checkpointer(root, compress="zstd", async_save=async_save) as ckpt:
        ckpt.save(1, model, optimizer, extra={"note": "zstd"})
    return {"state": full_state(model, optimizer)}


# --- FSDP + TP on a 2-D mesh, saved and loaded with plain torch (for reshard --like) -------------


class TPNet(torch.nn.Module):
    """An MLP for tensor parallelism: ``w1`` colwise (rows over tp), ``w2`` rowwise (columns over
    tp, so its chunks are cut along dim 1), a LayerNorm replicated over tp."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.w2(torch.relu(self.w1(x))))


def tpnet_sharded(tp: int):
    """TPNet under FSDP2 over all ranks (``tp`` = 1), or TP over ``tp`` ranks and FSDP2 over the
    rest on a ``(dp, tp)`` mesh; the same full weights whatever the layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = TPNet()
    world = dist.get_world_size()
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def tpnet_save(path: str, tp: int, train: bool) -> dict[str, object]:
    """Plain dcp.save of TPNet + AdamW (after one step when ``train``; else its initial state, as a
    new job saves it for ``reshard --like``); returns the full state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optimizer = tpnet_sharded(tp)
    if train:
        model(torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32).sum().backward()
        optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    fmsd, fosd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": fmsd, "optim": fosd}


def tpnet_load(path: str, tp: int) -> dict[str, object]:
    """Plain dcp.load into a fresh (zeroed) TPNet + AdamW laid out with ``tp``; the full state after."""
    return load_zeroed(*tpnet_sharded(tp), checkpoint_id=path)

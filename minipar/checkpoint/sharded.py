"""Sharded checkpoints: every rank writes the pieces it holds; any layout reads them back.

The idea: a checkpoint stores the *logical* training state (logical_state.py: each parameter's full
tensor and its optimizer states, as pieces with their place in it) and not the saving layout's
buffers. Each rank writes one file of its pieces, each piece once (the lowest rank holding a replica
writes it); rank 0 then writes a manifest naming the step, the model, the layout, every logical
tensor's full shape and where its pieces are. To resume, each rank reads the pieces of the tensors it
needs, puts each tensor back together and cuts its own piece for the new layout: dp, tp, pp, ZeRO
stage and world size may all change.

    DIR/manifest.json               the commit point: written last, atomically
    DIR/.minipar-checkpoints        the marker: this folder is minipar's (written before the first save)
    DIR/step-000006/rank00000.npz   one file per rank of the saving layout: {"name/kind": piece}
    DIR/step-000006/rank00001.npz   ...

Atomic: every file is written as NAME.tmp, fsynced and renamed (a rename is all or nothing), and a
save goes to a new step folder; only once every rank's file is in place does rank 0 replace the
manifest the same way, and only then remove the previous folder. A crash at any moment leaves the
old manifest with its complete folder, or the new manifest with its.

Nothing of the user's is overwritten: --save refuses a folder that holds a manifest.json without the
marker save() writes (`foreign_manifest`), and a save deletes only the step folders it made. Reading
is as careful: the manifest and every shard must be regular files (a FIFO would block, /dev/zero would
never end), and a shard's size is compared with the manifest's before a byte of it is read.

--save-async (`start_save`, `finish_save`): the same files and commit, with this rank's pieces copied at
the step boundary and written by a thread that does file I/O only while training goes on; at a later
step boundary, once one small collective says every rank's writer is done, the main thread gathers
the shards' digests and rank 0's writer thread writes the manifests and prunes (in save()'s order);
the boundary after that learns the outcome. At most one save is in flight. It saves the step time of
the writing, hashing, fsyncs and unlinks (not of the copy), and costs a copy of the pieces in memory
meanwhile and a core for the writer: the shard is written from the arrays' own memory and hashed
through a memory map (`write_npz`), so the writer thread holds the GIL very little.

What is saved: the parameters and optimizer states, the optimizer's step count, the loss scaler (fp16),
FP8's delayed amax history (by layer name, in the manifest) and the step. The step is also the data
position and the random state: a batch is a pure function of (seed, step), and training draws no other
random numbers (dropout is 0), so the seed and the step restore every generator. What it costs: one
read of every piece a rank needs, and at load time every rank reads the manifest and checks every
file's size and SHA-256 before any collective, so a bad checkpoint is one error on every rank, not a
hang. Every rank must see DIR (one machine, or a shared file system), as with PyTorch's distributed
checkpoints.

What it needs of a run: the engine (trainer/engine.py: its cfg, grid.world, model, updater and
loss_scaler); the updater answers `checkpoint_pieces` and `load_logical` (parallel/api.py). The model
identity a checkpoint must match comes from the model's config (core/nn.py's GPTConfig or MLPConfig),
passed in by the caller where no model exists yet (config validation). Lesson: lessons/12_reliability.md.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import queue
import re
import shutil
import stat
import threading
import zipfile
from pathlib import Path

import numpy as np

from minipar.core import optim
from minipar.core.module import Module
from minipar.core.moe import MoEConfig, MoEGPT
from minipar.core.nn import GPT, GPTConfig, MLPConfig, MLPNet
from minipar.distributed.faults import inject_fault
from minipar.parallel.logical_state import Piece, assemble
from minipar.precision import fp8

FORMAT = "minipar-checkpoint-1"
MANIFEST = "manifest.json"
MARKER = ".minipar-checkpoints"  # in DIR: minipar wrote this folder's manifest (never the user's own)
MARKER_TEXT = f"{FORMAT}: the checkpoints of minipar train live here (minipar/checkpoint/sharded.py)\n"
MANIFEST_MAX_BYTES = 64 * 2**20  # a manifest is a few lines per tensor: more is not one of ours
FOLDER = re.compile(r"step-\d{6}(\.\d+)?")  # the folders save() makes ...
SHARD_FILE = re.compile(r"(rank\d{5}\.npz|manifest\.json)(\.tmp)?")  # ... and the only files in them


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message is one line, for the user."""


# ---- saving ----------------------------------------------------------------------------------------


def save(directory, engine, step: int, keep: int = 1) -> None:
    """Write the state of `engine` after `step` steps to `directory`, keeping the `keep` newest
    checkpoints (this one included). Collective over the world."""
    directory, world = Path(directory), engine.grid.world
    held = engine.updater.checkpoint_pieces()
    keys = {(name, kind, piece) for name, kinds in held.items() for kind, (piece, _) in kinds.items()
            if piece.full_shape != ()}  # counts (AdamW's step) go into the manifest
    counts = {name: {kind: int(count) for kind, (piece, count) in kinds.items() if piece.full_shape == ()}
              for name, kinds in held.items()}
    history = amax_history(engine)  # fp8: the delayed scales' history, every stage's layers (a collective)
    earlier = set().union(*world.allgather_obj(keys)[: world.rank])  # held by a lower rank: it writes them
    mine = sorted(keys - earlier, key=lambda key: key[:2])
    file = written = None
    folder, problem = world.bcast_obj(_attempt(new_folder, directory, step) if world.rank == 0 else None)
    if problem is None:
        file = f"{folder}/rank{world.rank:05d}.npz"
        arrays = {f"{name}/{kind}": held[name][kind][1] for name, kind, _ in mine}
        written, problem = _attempt(write_npz, directory / file, arrays, world.rank)
    # a full disk on any rank: every rank learns it here, none waits, the last manifest stays as it was
    files = world.gather_obj((file, *written, mine, counts) if problem is None else problem)
    if world.rank == 0:
        problem = next((entry for entry in files if isinstance(entry, str)), None)
        if problem is None:
            _, problem = _attempt(commit, directory, engine, step, folder, files, keep, history)
    problem = world.bcast_obj(problem)  # no rank returns before the checkpoint is committed
    if problem is not None:
        raise SaveFailed(f"--save {directory}: the checkpoint of step {step} was not written ({problem}); "
                         "the previous one is intact")


class SaveFailed(OSError):
    """A save that could not write its files (a full disk): every rank raises it with the same line."""


# ---- saving asynchronously (--save-async) ------------------------------------------------------------
#
# The same files and commit as save(), cut in stages: at the step boundary of the save, `start_save`
# agrees on the folder and which rank writes which piece (the collectives save() makes), takes this
# rank's pieces (copies: checkpoint_pieces hands out host copies, which the optimizer's next step does
# not touch) and hands them to a thread that only writes files (no MPI call: the main thread's
# collectives must stay in the same order on every rank); training goes on. At each later
# step boundary `finish_save` asks, by one small collective, whether every rank's writer is done. Once
# the shards are: the gather of their sizes and digests, then rank 0's writer writes the manifests (the
# commit point) and prunes, in save()'s order; the boundary after that learns its outcome (one broadcast)
# and the save is over. The main thread decides, and the writers do the writing, fsyncs and unlinks
# included. With `wait` (the next save, the end of the run), each stage is waited for. A kill at any
# moment leaves the last committed checkpoint: nothing is renamed over it before every shard is
# durable, and nothing is pruned before the new manifest is.


class Writer:
    """This process's checkpoint writer: one daemon thread, started at the first asynchronous save, that
    runs the tasks handed to it in order (file I/O only, never an MPI call). One thread for all saves:
    starting a thread makes the caller wait until the new one runs, a time slice on a busy machine."""

    def __init__(self):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def run(self, task) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.serve, name="minipar-checkpoint-writer", daemon=True)
            self.thread.start()
        self.tasks.put(task)

    def serve(self) -> None:
        while True:
            self.tasks.get()()


WRITER = Writer()


class PendingSave:
    """A save in flight: its step, folder and stage ("shards": every rank's writer writes its file;
    "commit": rank 0's writes the manifests and prunes), and the stage's outcome."""

    def __init__(self, directory: Path, step: int, folder: str, file: str, mine: list, counts: dict,
                 keep: int, head: dict):
        self.directory, self.step, self.folder, self.file = directory, step, folder, file
        self.mine, self.counts, self.keep, self.head = mine, counts, keep, head  # head: at the step saved
        self.stage = "shards"
        self.written: tuple | None = None  # what the stage's work returned: the shard's (size, SHA-256)
        self.problem: str | None = None
        self.finished: threading.Event | None = None  # set when the writer is done; None: nothing to write

    def start(self, work, *args) -> None:
        """Have the writer thread run work(*args): file I/O only."""
        self.finished = threading.Event()
        WRITER.run(lambda: self.attempt(work, *args))

    def attempt(self, work, *args) -> None:  # on the writer thread
        try:
            self.written, self.problem = _attempt(work, *args)
        except Exception as error:  # reported at a boundary, on every rank, like a full disk
            self.problem = f"{type(error).__name__}: {error}"
        finally:
            self.finished.set()

    def done(self) -> bool:
        return self.finished is None or self.finished.is_set()

    def wait(self) -> None:
        if self.finished is not None:
            self.finished.wait()  # file I/O only: it ends, or an error ends it

    def failed(self, problem: str) -> SaveFailed:
        return SaveFailed(f"--save {self.directory}: the checkpoint of step {self.step} was not written "
                          f"({problem}); the previous one is intact")


def start_save(directory, engine, step: int, keep: int = 1) -> PendingSave:
    """Begin a save of the state after `step` steps: collective over the world, then this rank's pieces
    are written by a thread. SaveFailed on every rank if the folder could not be made."""
    directory, world = Path(directory), engine.grid.world
    held = engine.updater.checkpoint_pieces()  # host copies (logical_state.to_host): the snapshot
    keys = {(name, kind, piece) for name, kinds in held.items() for kind, (piece, _) in kinds.items()
            if piece.full_shape != ()}
    counts = {name: {kind: int(count) for kind, (piece, count) in kinds.items() if piece.full_shape == ()}
              for name, kinds in held.items()}
    earlier = set().union(*world.allgather_obj(keys)[: world.rank])
    mine = sorted(keys - earlier, key=lambda key: key[:2])
    folder, problem = world.bcast_obj(_attempt(new_folder, directory, step) if world.rank == 0 else None)
    pending = PendingSave(directory, step, folder, f"{folder}/rank{world.rank:05d}.npz", mine, counts, keep,
                          manifest_head(engine, step, amax_history(engine)))
    if problem is not None:
        raise pending.failed(problem)
    snapshot = {f"{name}/{kind}": held[name][kind][1] for name, kind, _ in mine}
    pending.start(write_npz, directory / pending.file, snapshot, world.rank)
    inject_fault(world.rank, "after the snapshot of its save", save="snapshot")  # tests: a kill here
    return pending


def finish_save(pending: PendingSave | None, engine, wait: bool = False) -> PendingSave | None:
    """At a step boundary: if every rank's writer is done with the stage of `pending` (or, with `wait`,
    once it is), take it to the next stage. Returns the save still in flight, or None once committed.
    Collective over the world."""
    while pending is not None:
        if wait:
            pending.wait()
        elif not engine.grid.world.allreduce_obj(int(pending.done()), op="min"):  # the agreement
            return pending
        pending = next_stage(pending, engine)
        if not wait:
            return pending
    return None


def next_stage(pending: PendingSave, engine) -> PendingSave | None:
    """Every writer is done with the stage: after the shards, rank 0's writer commits (None: committed)."""
    world = engine.grid.world
    if pending.stage == "commit":  # rank 0's writer wrote the manifests; the others had nothing to do
        problem = world.bcast_obj(pending.problem)
        if problem is not None:
            raise pending.failed(problem)
        return None
    mine = (pending.file, *pending.written, pending.mine, pending.counts) if pending.problem is None \
        else pending.problem
    files = world.gather_obj(mine)
    problem = None
    if world.rank == 0:
        problem = next((entry for entry in files if isinstance(entry, str)), None)
    problem = world.bcast_obj(problem)
    if problem is not None:
        raise pending.failed(problem)
    pending.stage, pending.finished = "commit", None
    if world.rank == 0:  # every shard is durable: the manifest may name them
        pending.start(write_manifests, pending.directory, pending.folder, (pending.head, files), pending.keep)
    return pending


def _attempt(write, *args):
    """(write(*args), None), or (None, the one-line reason) when the file system refused."""
    try:
        return write(*args), None
    except OSError as error:
        where = f" {error.filename}" if error.filename else ""
        return None, f"{error.strerror or error}{where}"


def commit(directory: Path, engine, step: int, folder: str, files: list, keep: int,
           history: dict | None = None) -> None:
    """Rank 0, once every rank's file is in place: the manifests, then the older folders go.
    `history`: FP8's amax history at the step saved (`amax_history`)."""
    write_manifests(directory, folder, (manifest_head(engine, step, history), files), keep)


def write_manifests(directory: Path, folder: str, parts: tuple[dict, list], keep: int) -> None:
    """Rank 0 (its writer thread with --save-async): the manifest of `parts` (manifest_head's, and
    the gathered files) written into the folder, then DIR's (the commit point); then the older
    folders go."""
    text = manifest_text(build_manifest(*parts, folder)).encode()
    inject_fault(0, "between the shards and the manifest", save="shards-written")  # tests: a kill here
    write_atomically(directory / folder / MANIFEST, text, 0, "manifest")  # --resume DIR/step-...
    write_atomically(directory / MANIFEST, text, 0, "manifest")  # the commit point
    inject_fault(0, "before pruning", save="committed")  # tests: a kill between the commit and the pruning
    remove_old_folders(directory, keep)


def new_folder(directory: Path, step: int) -> str:
    """A fresh folder for this save's files, never the one the current manifest names."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / MARKER).is_file():  # before the first manifest: from now on the folder is ours
        write_atomically(directory / MARKER, MARKER_TEXT.encode(), 0, "marker")
    current = committed_folder(directory)
    name, n = f"step-{step:06d}", 0
    # never the committed folder, nor a folder of the user's that happens to have the name
    while name == current or ((directory / name).exists() and not written_by_save(directory / name)):
        n += 1
        name = f"step-{step:06d}.{n}"
    shutil.rmtree(directory / name, ignore_errors=True)  # left behind by a save that crashed
    (directory / name).mkdir(parents=True)
    return name


def committed_folder(directory: Path) -> str | None:
    try:
        return json.loads(read_regular_file(directory / MANIFEST, MANIFEST_MAX_BYTES))["folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes`; OSError (strerror: why) for anything else.

    Opened without blocking (a FIFO would wait for a writer for ever) and checked with fstat before a
    byte is read (a symlink to /dev/zero never ends)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as f:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if status.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{status.st_size} bytes, more than the {max_bytes} expected")
        return f.read(max_bytes + 1)


def foreign_manifest(directory) -> str | None:
    """--save DIR: why DIR is not ours to write a manifest into, or None. A folder is minipar's when it
    holds the marker save() writes, or (checkpoints saved before the marker) when its manifest.json is
    a minipar manifest whose digest checks; a folder without a manifest.json may hold anything else."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if (directory / MARKER).is_file() or not (manifest.exists() or manifest.is_symlink()):
        return None
    try:
        content = json.loads(read_regular_file(manifest, MANIFEST_MAX_BYTES))
        if isinstance(content, dict) and content.get("format") == FORMAT and \
                content.get("sha256") == manifest_digest(content):
            return None
    except (OSError, ValueError, TypeError):
        pass
    return (f"--save {directory} holds a {MANIFEST} that minipar did not write (no {MARKER} there): "
            "saving would overwrite it; choose another folder")


def write_npz(path: Path, arrays: dict, rank: int) -> tuple[int, str]:
    """Write the arrays as one .npz file, atomically (as write_atomically does); return its size and
    SHA-256. The bytes are np.savez's, written straight into PATH.tmp: each array's own memory goes
    to the zip's CRC and to the file, and the hash reads the file back through a memory map, so no
    copy is made and the large calls (CRC, write, fsync, SHA-256) release the GIL: the writer thread
    of --save-async leaves the interpreter to training (lessons/12_reliability.md)."""
    temporary, items = path.with_name(path.name + ".tmp"), list(arrays.items())
    with open(temporary, "wb+") as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:  # np.savez's own calls, unbuffered
            add_arrays(archive, items[: len(items) // 2])
            inject_fault(rank, "while saving its shard", save="shard")  # tests: a crash, half written
            add_arrays(archive, items[len(items) // 2 :])
        f.flush()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as written:
            digest = hashlib.sha256(written).hexdigest()  # of the bytes in the file, not of a copy
    inject_fault(rank, "before renaming its shard", save="shard-fsynced")  # tests: written, not renamed
    os.replace(temporary, path)
    fsync_directory(path.parent)  # the rename itself reaches the disk
    return size, digest


def add_arrays(archive: zipfile.ZipFile, items: list) -> None:
    """Each (name, array) as NAME.npy in the archive, as np.savez writes it."""
    for name, array in items:
        array = np.ascontiguousarray(array)
        with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, np.lib.format.header_data_from_array_1_0(array))
            member.write(array.reshape(-1).view(np.uint8))  # the array's own memory: no copy


def write_atomically(path: Path, data: bytes, rank: int, phase: str) -> None:
    """PATH.tmp, written and fsynced, then renamed to PATH: readers see the old file or the new, whole."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data[: len(data) // 2])
        inject_fault(rank, f"while saving its {phase}", save=phase)  # tests: a crash, the file half written
        f.write(data[len(data) // 2 :])
        f.flush()
        os.fsync(f.fileno())
    inject_fault(rank, f"before renaming its {phase}", save=f"{phase}-fsynced")  # tests: written, not renamed
    os.replace(temporary, path)
    fsync_directory(path.parent)  # the rename itself reaches the disk


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def manifest_head(engine, step: int, history: dict | None = None) -> dict:
    """What the manifest says of the run, the model, the loss scaler and FP8's delayed amax history
    (`history`: amax_history's, a collective every rank made), as they are at `step`."""
    cfg = engine.cfg
    return {
        "format": FORMAT,
        "step": step,
        "seed": cfg.seed,
        "model": model_identity(cfg, engine.model.config),
        "layout": {"world_size": engine.grid.world.size, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                   "cp": cfg.cp, "zero": cfg.zero, "offload": cfg.offload, "precision": cfg.precision},
        "run": run_settings(cfg),
        "loss_scaler": loss_scaler_state(engine),
        "fp8_amax_history": history or None,
    }


def build_manifest(head: dict, files: list, folder: str) -> dict:
    """The manifest: the head, the folder, every rank's file and where each piece of each tensor is."""
    tensors: dict = {}
    for file, _, _, entries, _ in files:
        for name, kind, piece in entries:
            tensor = tensors.setdefault(name, {"shape": list(piece.full_shape), "counts": {}, "pieces": {}})
            tensor["pieces"].setdefault((file, piece), {"file": file, **piece.to_json(), "kinds": []})
            tensor["pieces"][(file, piece)]["kinds"].append(kind)
    for *_, counts in files:
        for name, held in counts.items():
            tensors[name]["counts"].update(held)
    for tensor in tensors.values():
        tensor["pieces"] = list(tensor["pieces"].values())
    files_of = {file: {"bytes": size, "sha256": digest} for file, size, digest, _, _ in files}
    return {**head, "folder": folder, "files": files_of, "tensors": dict(sorted(tensors.items()))}


def amax_history(engine) -> dict | None:
    """FP8's delayed amax history, every stage's layers, on rank 0 (which writes the manifest; None
    elsewhere). A collective over the world in fp8: the pipeline's stages hold different layers, the dp
    and tp ranks of one the same, agreed, history."""
    if engine.cfg.precision != "fp8":
        return None
    gathered = engine.grid.world.gather_obj(fp8.amax_history(engine.runner), root=0)
    if gathered is None:
        return None
    merged: dict = {}
    for history in gathered:
        merged.update(history)
    return merged


def loss_scaler_state(engine) -> dict | None:
    return dict(engine.loss_scaler.state_dict()) if engine.loss_scaler is not None else None


def run_settings(cfg) -> dict:
    """What changes the mathematics of the steps to come, though not the model: --resume checks it,
    and a change needs --allow-changes. (Micro-batches, like the layout, precision, --fused and
    --recompute, may change freely.) SGD's momentum and MoE's aux-loss weight where they are used."""
    settings = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size}
    if cfg.optimizer == "sgd":
        settings["momentum"] = cfg.momentum
    if cfg.model == "moe":
        settings["aux_loss_coef"] = cfg.aux_loss_coef
    return settings


def changed_settings(manifest: dict, cfg) -> dict:
    """{option: (saved, now)} for each run setting this run changes (a setting a checkpoint saved
    before it was recorded cannot be compared)."""
    saved = manifest["run"]
    return {key: (saved[key], value) for key, value in run_settings(cfg).items()
            if key in saved and saved[key] != value}


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's content (every key but the digest, as sorted JSON): an edited or
    damaged manifest that still parses is refused like a damaged shard file."""
    content = {key: value for key, value in manifest.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def manifest_text(manifest: dict) -> str:
    """The manifest as JSON that a reader can scan: one line per logical tensor; its digest last."""
    manifest = {**manifest, "sha256": manifest_digest(manifest)}
    tensors = ",\n".join(f"  {json.dumps(name)}: {json.dumps(tensor)}"
                          for name, tensor in manifest["tensors"].items())
    text = json.dumps({**manifest, "tensors": None}, indent=1)
    return text.replace('"tensors": null', '"tensors": {\n' + tensors + "\n }") + "\n"


def written_by_save(path: Path) -> bool:
    """A folder save() made: its name and every file in it are save()'s own (the user's `step-notes/`,
    or a step-000002/ holding anything else, is not ours to delete)."""
    return (path.is_dir() and not path.is_symlink() and FOLDER.fullmatch(path.name) is not None
            and all(entry.is_file() and SHARD_FILE.fullmatch(entry.name) for entry in path.iterdir()))


def saved_step(path: Path) -> tuple[int, int] | None:
    """(step, n) of a committed checkpoint folder (its own manifest is there), else None."""
    if not written_by_save(path) or not (path / MANIFEST).is_file():
        return None
    step, _, n = path.name.removeprefix("step-").partition(".")
    return int(step), int(n or 0)


def remove_old_folders(directory: Path, keep: int) -> None:
    """Once a checkpoint is committed: keep the `keep` newest committed folders; remove the older ones
    and the debris of saves that crashed (a folder without its manifest), never anything else."""
    current = committed_folder(directory)
    others = sorted((p.name for p in directory.iterdir() if p.name != current and saved_step(p)),
                    key=lambda name: saved_step(directory / name), reverse=True)
    kept = {current, *others[: keep - 1]}
    for path in directory.iterdir():
        if path.name not in kept and written_by_save(path):
            shutil.rmtree(path, ignore_errors=True)


def model_identity(cfg, model_config) -> dict:
    """What a checkpoint and a run must agree on: the model (its kind and config: so every tensor's name
    and shape) and the optimizer (so its states). Layout and precision may differ: the tensors are
    re-cut and cast, so the config's dtype is left out."""
    model = dataclasses.asdict(model_config)
    model.pop("dtype")
    if cfg.model == "moe":  # the experts (their names) and how tokens reach them (core/moe.py)
        model.update(n_experts=cfg.n_experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor)
    return {"model": cfg.model, **model, "optimizer": cfg.optimizer}


_LOCKS: list[int] = []  # descriptors of the save folders this process holds, until it ends


def lock_problems(directory) -> list[str]:
    """Take the save folder for this process (rank 0 of the job): [] or why another job has it.

    An exclusive flock on the folder itself (no lock file to leave behind), released by the system
    when the process ends however it ends; two jobs saving to one folder would delete each other's
    step folders and overwrite the manifest. One machine, or a file system whose flock is shared."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError as error:
        return [f"--save {directory}: {error.strerror}"]
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return [f"--save {directory} is in use: another run is saving there (wait for it, or choose "
                "another folder)"]
    _LOCKS.append(descriptor)
    return []


# ---- checking and loading ----------------------------------------------------------------------------


def read_manifest(directory, cfg, model_config) -> dict:
    """The manifest of a checkpoint this run can resume from; CheckpointError (one line) otherwise.

    No collective: every rank runs it and reaches the same verdict. Checks that the manifest is there
    and whole, that every file it names is there with its size and SHA-256, and that the checkpoint
    is of this model (`model_config`) and optimizer, at a step no later than --steps."""
    directory = Path(directory)
    where = f"--resume {directory}"
    if not directory.is_dir():
        raise CheckpointError(f"{where}: no such directory")
    try:
        manifest = json.loads(read_regular_file(directory / MANIFEST, MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no {MANIFEST} (not a checkpoint, or a save that never finished)") \
            from None
    except OSError as e:
        raise CheckpointError(f"{where}: {MANIFEST} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: {MANIFEST} is unreadable or truncated ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST} is not a {FORMAT} manifest")
    try:
        check_against(manifest, base_of(directory, manifest), model_identity(cfg, model_config), cfg, where)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON, but not what save() writes
        raise CheckpointError(f"{where}: {MANIFEST} is malformed (at {e!r})") from None
    return manifest


def base_of(directory: Path, manifest: dict) -> Path:
    """The folder the manifest's file names start from: DIR, or DIR's parent for DIR/step-000008."""
    return directory.parent if manifest.get("folder") == directory.name else directory


def check_against(manifest: dict, directory: Path, identity: dict, cfg, where: str) -> None:
    if manifest["sha256"] != manifest_digest(manifest):
        raise CheckpointError(f"{where}: {MANIFEST} was altered: its SHA-256 differs from the one it records")
    for key in ("step", "seed"):
        if not is_count(manifest[key]):
            raise CheckpointError(f"{where}: {MANIFEST} is malformed ({key} {manifest[key]!r} is not a "
                                  "non-negative integer)")
    for file, expected in manifest["files"].items():
        if not re.fullmatch(re.escape(str(manifest["folder"])) + r"/rank\d{5}\.npz", file):
            raise CheckpointError(f"{where}: {MANIFEST} lists {file!r}, not a file of its folder")
        check_file(directory / file, expected, f"{where}: {file}")
    differences = [f"{key} {manifest['model'].get(key)!r} there, {value!r} here"
                   for key, value in identity.items() if manifest["model"].get(key) != value]
    if differences:
        raise CheckpointError(f"{where}: a checkpoint of another model ({', '.join(differences)})")
    check_tensors(manifest, expected_tensors(cfg.optimizer, cfg.momentum, cfg.model, identity), where)
    check_loss_scaler(manifest["loss_scaler"], where)
    check_amax_history(manifest.get("fp8_amax_history"), where)  # absent before it was saved: None
    if manifest["seed"] != cfg.seed:
        raise CheckpointError(f"{where}: saved with --seed {manifest['seed']}, and the data position "
                              f"is (seed, step): resume with --seed {manifest['seed']}")
    changes = changed_settings(manifest, cfg)
    if changes and not cfg.allow_changes:
        listed = ", ".join(f"--{key.replace('_', '-')} {saved} there, {now} here"
                           for key, (saved, now) in changes.items())
        raise CheckpointError(f"{where}: the run changes {listed}; pass --allow-changes to resume so")
    if manifest["step"] > cfg.steps:
        raise CheckpointError(f"{where}: the checkpoint is at step {manifest['step']}, past --steps "
                              f"{cfg.steps} (--steps counts all steps, those before the checkpoint too)")


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_amax_history(history, where: str) -> None:
    """None, or FP8's amax history as `amax_history` writes it: layer -> tensor -> non-negative amaxes."""
    if history is None:
        return
    if not (isinstance(history, dict) and all(
            isinstance(tensors, dict) and all(isinstance(past, list) and all(
                isinstance(a, (int, float)) and math.isfinite(a) and a >= 0 for a in past)
                for past in tensors.values()) for tensors in history.values())):
        raise CheckpointError(f"{where}: {MANIFEST} is malformed (fp8_amax_history is not an amax history: "
                              "layer -> tensor -> a list of non-negative amaxes)")


def check_loss_scaler(state, where: str) -> None:
    """None, or the fp16 loss scaler's state as DynamicLossScaler.state_dict writes it, in range."""
    if state is None:
        return
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    valid = isinstance(state, dict) and set(state) == LOSS_SCALER_KEYS and number(state["scale"]) and \
        state["scale"] > 0 and number(state["growth_factor"]) and state["growth_factor"] >= 1 and \
        number(state["backoff_factor"]) and 0 < state["backoff_factor"] <= 1 and \
        is_count(state["growth_interval"]) and state["growth_interval"] >= 1 and \
        is_count(state["_growth_tracker"])
    if not valid:
        raise CheckpointError(f"{where}: {MANIFEST} is malformed (loss_scaler {state!r} is not a loss "
                              "scaler's state: scale, growth and backoff factors, interval and tracker "
                              "in range)")


LOSS_SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


def expected_tensors(optimizer: str, momentum: float, model: str, identity: dict) -> dict:
    """{name: (full shape, the kinds of arrays, the kinds of counts)} of the model and optimizer a
    run resumes: what a checkpoint must hold for it (built on the full model, no weights drawn)."""
    fields = {key: value for key, value in identity.items() if key not in ("model", "optimizer")}
    routing = {key: fields.pop(key) for key in ("n_experts", "top_k", "capacity_factor") if key in fields}
    net: Module
    if model == "moe":
        net = MoEGPT(GPTConfig(**fields), MoEConfig(**routing), seed=None)
    elif model == "gpt":
        net = GPT(GPTConfig(**fields), seed=None)
    else:
        net = MLPNet(MLPConfig(**fields), seed=None)
    rule = optim.SGD([], lr=1.0, momentum=momentum) if optimizer == "sgd" else optim.AdamW([], lr=1.0)
    state = rule.init_state(1, "float64", np)
    arrays = {"param"} | {kind for kind, value in state.items() if hasattr(value, "shape")}
    counts = {kind for kind, value in state.items() if not hasattr(value, "shape")}
    return {name: (tuple(p.full_shape), arrays, counts) for name, p in net.named_parameters()}


def check_tensors(manifest: dict, expected: dict, where: str) -> None:
    """Every tensor the run needs is there with its shape, all its kinds and counts, and pieces that
    cover each element exactly once, each in a file the manifest lists (so verified above)."""
    tensors = manifest["tensors"]
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: the checkpoint has no tensor {missing[0]!r}")
    for name, (shape, arrays, counts) in expected.items():
        tensor, what = tensors[name], f"{where}: tensor {name!r}"
        if not (isinstance(tensor["shape"], list) and all(is_count(n) for n in tensor["shape"])) \
                or tuple(tensor["shape"]) != shape:
            raise CheckpointError(f"{what} has shape {tensor['shape']}, the model's is {list(shape)}")
        # the optimizer's state is made at its first step: all of it there, or none (steps skipped)
        held = {kind for entry in tensor["pieces"] for kind in entry["kinds"]} | set(tensor["counts"])
        state = (arrays | counts) - {"param"}
        if held & state and state - held:
            raise CheckpointError(f"{what}: its optimizer state {sorted(state - held)[0]!r} is missing")
        for kind in sorted(counts & held):
            if not is_count(tensor["counts"][kind]):
                count = tensor["counts"][kind]
                raise CheckpointError(f"{what}: its count {kind!r} is {count!r}, not a count")
        for kind in sorted(arrays & held | {"param"}):
            pieces = [entry for entry in tensor["pieces"] if kind in entry["kinds"]]
            if not pieces:
                raise CheckpointError(f"{what}: its {kind!r} is missing")
            check_cover(pieces, shape, manifest["files"], f"{what} ({kind})")


def check_cover(entries: list, shape: tuple, files: dict, what: str) -> None:
    """The pieces of one kind together hold every element of the full tensor once, in listed files."""
    numbered = np.arange(1, int(np.prod(shape)) + 1).reshape(shape)  # 0 marks a padding row
    seen = np.zeros(numbered.size + 1, dtype=np.int64)
    for entry in entries:
        if entry["file"] not in files:
            raise CheckpointError(f"{what}: a piece is in {entry['file']!r}, which the manifest does not "
                                  "list")
        try:
            piece = Piece.from_json(entry, shape)
            held = piece.cut(numbered).reshape(-1)
            flat = piece.flat or (0, held.size)
            valid = (piece.shard is None or 0 <= piece.shard.start < piece.shard.stop) and \
                0 <= flat[0] < flat[1] <= int(np.prod(piece.local_shape())) and held.size == flat[1] - flat[0]
        except (TypeError, ValueError, IndexError):
            valid = False
        if not valid:
            where = f"{entry.get('shard')}, {entry.get('flat')}"
            raise CheckpointError(f"{what}: a piece {where} is out of range")
        np.add.at(seen, held, 1)
    seen[0] = 1  # padding
    if (seen != 1).any():
        holes, twice = int((seen == 0).sum()), int((seen > 1).sum())
        raise CheckpointError(f"{what}: its pieces leave {holes} elements out and hold {twice} twice")


def check_file(path: Path, expected: dict, what: str) -> None:
    """The file is a regular file of the manifest's size (checked before reading) and SHA-256."""
    if not is_count(expected["bytes"]):
        raise CheckpointError(f"{what}: the manifest gives its size as {expected['bytes']!r}")
    try:
        data: bytes | None = read_regular_file(path, expected["bytes"])
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing") from None
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise CheckpointError(f"{what} cannot be read ({e.strerror})") from None
        data = None  # longer than the manifest says: not read
    if data is None or len(data) != expected["bytes"]:
        raise CheckpointError(f"{what} is truncated or altered: {os.stat(path).st_size} bytes, the "
                              f"manifest says {expected['bytes']}")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{what} is corrupt: its SHA-256 differs from the manifest's")


def problems(cfg, model_config) -> list[str]:
    """trainer/validate.py's check of --resume: [] or the one-line reason the checkpoint is refused.

    `model_config` is the config of the model `cfg` builds (trainer/build.py's model_config)."""
    try:
        read_manifest(cfg.resume, cfg, model_config)
    except CheckpointError as e:
        return [str(e)]
    return []


class SavedState:
    """The logical tensors of a checkpoint, read on demand: state[name] -> {kind: full array}.

    A rank asks only for the parameters it holds, and reads only their pieces from the files."""

    def __init__(self, directory: Path, manifest: dict):
        self.directory, self.tensors, self.files = directory, manifest["tensors"], {}

    def __getitem__(self, name: str) -> dict:
        tensor, pieces = self.tensors[name], {}
        for entry in tensor["pieces"]:
            piece = Piece.from_json(entry, tensor["shape"])
            for kind in entry["kinds"]:
                pieces.setdefault(kind, []).append((piece, self.file(entry["file"])[f"{name}/{kind}"]))
        return {**{kind: assemble(held) for kind, held in pieces.items()}, **tensor["counts"]}

    def file(self, name: str):
        if name not in self.files:
            self.files[name] = np.load(self.directory / name)
        return self.files[name]

    def close(self):
        for file in self.files.values():
            file.close()


def changes_on_resume(directory, cfg) -> dict:
    """{option: [saved, now]}: the run settings a resume with --allow-changes changed (for the log)."""
    manifest = json.loads(read_regular_file(Path(directory) / MANIFEST, MANIFEST_MAX_BYTES))
    return {key: list(pair) for key, pair in changed_settings(manifest, cfg).items()}


def load(directory, engine) -> int:
    """Set the engine's state from the checkpoint in `directory`; return its step. Every rank calls it:
    an FP8 ZeRO-3 updater agrees the scales of groups its shards cut (an all-reduce over dp) as it loads."""
    manifest = read_manifest(directory, engine.cfg, engine.model.config)
    state = SavedState(base_of(Path(directory), manifest), manifest)
    # first: ZeRO-3 in FP8 quantizes the loaded shards with the delayed scales (precision/fp8_zero3.py)
    fp8.load_amax_history(engine.runner, manifest.get("fp8_amax_history"))
    try:
        engine.updater.load_logical(state)
    finally:
        state.close()
    if engine.loss_scaler is not None and manifest["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    return manifest["step"]

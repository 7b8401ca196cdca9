"""What an update costs as torchrun's CPU ranks against one process, on the same samples (issue 74, item 2).

    python docs/rank_update.py                                                   # one process, torch's threads
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 docs/rank_update.py            # two ranks of one thread
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 docs/rank_update.py --keep_gathered   # or --hsdp, --replicate

The samples are bench.py train's: the CPU default's cached tiny base (built by any `python train.py` first),
three tree rollouts of 16 compact Plan-Path envs, AT-GRPO's advantages; each rank takes the envs of its own
parity. train.update_policy runs on them `--reps` times over (the weights move on, the work stays the same); the
line gives the median seconds an update, and each rank the seconds it spent waiting in c10d (cProfile, one pass
over the three). --keep_gathered: FSDP2's reshard_after_forward=False on every unit (each unit's weights stay
gathered from its forward to its backward: one all-gather less a micro-batch, torchtitan's "never" policy);
--hsdp: FSDP2 over a (world, 1) mesh (replicated, a shard of one); --replicate: no FSDP2, DDP's composable
`replicate` (whole weights on every rank, gradients all-reduced in backward). A probe: it times, it does not
compare the layouts' weights (test_all's FSDP2 tests do that for the layout train.py uses)."""
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed.fsdp as fsdp  # noqa: E402

import common as C  # noqa: E402
import envs as E  # noqa: E402
import model as M  # noqa: E402
import tiny  # noqa: E402
import train as T  # noqa: E402
from grpo_mas import compute_advantages  # noqa: E402
from policies import _make_model, make_engine  # noqa: E402
from rollout import Agents, every_role, tree_rollout  # noqa: E402

if "--keep_gathered" in sys.argv:
    shard_unit = fsdp.fully_shard
    fsdp.fully_shard = lambda *a, **k: shard_unit(*a, **k, reshard_after_forward=False)
reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 3
rank, world = C.setup_dist()
cfg = T.configure([])
base = tiny.base_path(cfg)
agents = Agents(M.load_tokenizer(base), [make_engine("torch", base, seed=0, max_len=cfg["max_model_len"])],
                {"tool": 0, "plan": 0}, cfg["max_prompt_tokens"])
sampling = every_role(temperature=1.0, top_p=1.0, max_new_tokens=cfg["max_new_tokens"])
rollouts = []
for r in range(3):  # every rank draws all three, then keeps its envs
    rng = random.Random(f"bench-{r}")
    envs = [E.train_env("plan", rng, "mas", True) for _ in range(cfg["envs_per_step"])]
    agents.seed_base = r
    samples = compute_advantages(tree_rollout(envs, agents, cfg["K"], cfg["turns"], sampling, 1.0, "greedy",
                                              rng), "at_grpo")[0]
    rollouts.append([s for s in samples if s.env % world == rank])
if "--replicate" in sys.argv:  # DDP's way: whole weights on every rank, gradients all-reduced in backward
    from torch.distributed._composable import replicate
    C.OWN_GROUP = False
    model = replicate(_make_model(cfg, base, C.DEVICE))
    C.OWN_GROUP = True
elif "--hsdp" in sys.argv:  # FSDP2 over a (world, 1) mesh: replicated across ranks, a shard of one (HSDP)
    from torch.distributed.device_mesh import init_device_mesh
    C.OWN_GROUP = False
    model = _make_model(cfg, base, C.DEVICE)
    C.OWN_GROUP = True
    M.shard(model, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
else:
    model = _make_model(cfg, base, C.DEVICE)  # FSDP2-sharded under torchrun, as train.py builds it
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
seconds, prof = [], cProfile.Profile()
for rep in range(reps):
    for samples in rollouts:
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        if rep == 1:
            prof.enable()
        T.update_policy(model, opt, samples, cfg, world, C.DEVICE)
        prof.disable()
        seconds.append(time.perf_counter() - t0)
waits = sum(v[2] for k, v in pstats.Stats(prof).stats.items() if k[2].endswith("c10d.wait>"))
print(f"rank {rank}: c10d waits {waits:.2f} s over one pass of 3 updates", flush=True)
if rank == 0:
    layout = [flag for flag in ("--keep_gathered", "--hsdp", "--replicate") if flag in sys.argv] or ["FSDP2"]
    print(f"world {world}, {torch.get_num_threads()} thread(s) a rank, {layout[0]}: an update "
          f"{statistics.median(seconds):.3f} s (median of {len(seconds)})")
C.close_dist()

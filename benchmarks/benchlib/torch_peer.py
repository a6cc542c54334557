"""One rank of the PyTorch DDP peer that tfdist is compared with (gloo, CPU).

PyTorch is optional (``pip install -e .[bench]``); it is imported when a rank runs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib.mlp import accuracy, initial_weights


def run_rank(settings: Any, layers: Sequence[int], data: tuple, out: Path) -> None:
    """Trains the MLP as one rank of a DDP job, writes its JSON to ``out``, and exits.

    Args:
        settings: The run's settings, as attributes (a script passes its absl
            ``FLAGS``): ``rank``, ``world``, ``port`` (the rendezvous on
            127.0.0.1), ``threads``, ``config`` (``ddp/dense``, ``ddp/fp16`` or
            ``ddp/powersgd:R``), ``warmup`` (PowerSGD's dense steps), ``seed``,
            ``learning_rate``, ``steps``, ``batch``, ``evals`` (evaluate every
            this many steps on rank 0; 0: never).
        layers: The MLP's widths.
        data: ``(xs, ys, xt, yt)``: this rank's rows and the held-out ones.
        out: Where the rank's result goes: step times, evaluations, the
            compression, buckets per step, parameters.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(1, settings.threads))
    rank, world = settings.rank, settings.world
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{settings.port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=900),
    )
    xs, ys, xt, yt = data
    mods: list = []
    for a, b in zip(layers[:-1], layers[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    init = initial_weights(layers)
    with torch.no_grad():
        for lin, w, b in zip(linears, init[::2], init[1::2]):
            lin.weight.copy_(torch.from_numpy(w.T.copy()))
            lin.bias.copy_(torch.from_numpy(b))
    # One bucket: PowerSGD with several buckets fails on gloo ("Received data
    # size doesn't match expected size").
    ddp = DistributedDataParallel(model, bucket_cap_mb=64)
    kind = settings.config.split("/", 1)[1]
    calls = [0]
    if kind == "fp16":
        hook, state = default_hooks.fp16_compress_hook, None
    elif kind.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(kind.split(":")[1]),
            start_powerSGD_iter=settings.warmup,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=settings.seed,
        )
        hook = powerSGD_hook.powerSGD_hook
    else:
        hook, state = default_hooks.allreduce_hook, None

    def counted(state, bucket):
        calls[0] += 1
        return hook(state, bucket)

    ddp.register_comm_hook(state, counted)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=settings.learning_rate, momentum=0.9)
    xs_t, ys_t = torch.from_numpy(xs), torch.from_numpy(ys)
    batch = settings.batch
    times: list[float] = []
    evals: list[list[float]] = []
    for step in range(settings.steps):
        xb = xs_t[step * batch : (step + 1) * batch]
        yb = ys_t[step * batch : (step + 1) * batch]
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if settings.evals and (step + 1) % settings.evals == 0 and rank == 0:
            weights = []
            for lin in linears:
                weights += [lin.weight.detach().numpy().T, lin.bias.detach().numpy()]
            evals.append([step + 1, accuracy(weights, xt, yt), sum(times)])
    Path(out).write_text(
        json.dumps(
            {
                "step_times": times,
                "evals": evals,
                "compression": kind,
                "buckets_per_step": calls[0] / max(1, settings.steps),
                "params": sum(p.numel() for p in model.parameters()),
                "rank": rank,
            }
        )
    )
    dist.barrier()
    # gloo sometimes aborts while the interpreter tears its threads down
    # ("terminate called without an active exception"), after the work is
    # done and written: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

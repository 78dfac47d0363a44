"""What each of two gloo processes does in ``test_multi_gpu.py`` (a module of its own: spawned children import it)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lungcal.calibration.handlers import CalibrationMetrics
from lungcal.runtime import distributed as D
from lungcal.runtime.resume import TrainingResume

#: the whole validation split of the check: 7 cases, 3 classes
N_CASES = 7


def split_logits() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N_CASES, 3, generator=g), torch.randint(0, 3, (N_CASES,), generator=g)


def worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2: shards, gathered metrics, rank-0-first, the resume state; writes ``rank<r>.json``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    D.init_process_group("cpu")
    result: dict = {"backend": dist.get_backend(), "world_size": D.world_size(), "rank": D.rank(),
                    "lungcal_hook_on_top": getattr(sys.excepthook, "lungcal_exit_hook", False)}
    cases = list(range(N_CASES))
    val = list(D.eval_shard(cases))
    train = D.train_shard(cases, seed=3)
    train.set_epoch(1)
    result.update(val=val, train=list(train))
    logits, labels = split_logits()
    metric = CalibrationMetrics(n_bins=5, key="auc")
    metric.reset()
    for i in val:  # one case per update, as an evaluator with batch size 1 on this rank's shard
        metric.update((logits[i:i + 1], labels[i:i + 1]))
    result["metrics"] = metric.compute()
    result["loss"] = D.mean_over_ranks(float(rank + 1))
    marker = Path(out) / "rank0_was_here"
    with D.rank_zero_first():
        result["saw_rank0_file"] = marker.is_file()
        if rank == 0:
            marker.write_text("built")
    # the resume state: rank 0 alone owns the lock and the files, every rank loads rank 0's file
    net = torch.nn.Linear(2, 1)
    state = TrainingResume(Path(out) / "resume" / "id", {"model": net})
    if rank == 0:
        torch.nn.init.constant_(net.weight, 2.0)
        state.dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model": net.state_dict(), "run": {"run_id": "r0"}}, state.dir / "resume_checkpoint_3.pt")
    D.barrier()
    result["resumed_from"] = state.load()
    result["weight_after_load"] = net.weight.flatten().tolist()
    result["writer"] = state.writer
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    D.barrier()
    D.destroy_process_group()

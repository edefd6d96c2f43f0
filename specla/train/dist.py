"""Process setup shared by the trainers: one process per GPU under torchrun, or a single one."""

from __future__ import annotations

import os

import torch


def setup(device: str = "auto") -> tuple[torch.device, int, int, bool]:
    """(device, rank, world size, distributed). Under torchrun: NCCL across GPUs, or gloo when
    there are none (so the same command runs, and is tested, on CPUs)."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        cuda = torch.cuda.is_available() and device != "cpu"
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        rank = torch.distributed.get_rank()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return dev, rank, torch.distributed.get_world_size(), True
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0, 1, False
    return torch.device(device), 0, 1, False


def wrap(module: torch.nn.Module, dev: torch.device, distributed: bool) -> torch.nn.Module:
    if not distributed:
        return module
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None)


def finish(distributed: bool) -> None:
    """End a run's process group once every rank is done: rank 0 exports after the last step
    while the others are already finished, and a rank tearing its group down alone aborted once
    on CPU ("terminate called without an active exception", gloo, test_torchrun_ddp_on_cpu)."""
    if distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()

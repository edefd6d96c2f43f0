"""Time-bounded, resumable training runs: the schedule, the clock, the stopping rule, the step
loop and the run's bookkeeping the three trainers share (`TrainingRun`).

A run trains for at most `max_minutes`, then checkpoints and exits; the same command resumes.
When the schedule length is not given, it is fixed after measuring the pace over
CALIBRATION_STEPS steps (after WARM_STEPS that include kernel compilation), so that the whole
schedule spans `total_minutes` of training. Under DDP every decision comes from rank 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch

from specla.train.dist import finish, setup

# Kernel compilation and autotuning go on for the first shapes a run meets: on the H200 a
# block-drafter run's steps 6-20 still ran ~5x slower than later ones, and calibrating over
# steps 6-35 fixed a schedule that ended after 149 s of a 270 s budget. Later the stalls are
# rarer but still there: DSpark's steps 31-60 (aa91f03) averaged 77 ms against the run's 36 ms
# (one 10-step window took 1.4 s, the others 0.4-0.5), so the schedule ended after 140 s of
# 240. The pace is the median of the calibration's 10-step windows: a stall moves it not at all.
WARM_STEPS = 30
CALIBRATION_STEPS = 100
WINDOW = 10


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine from the peak down to 10% of it at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


FIRST_STEPS = 5


def _calibration_mark(n: int) -> bool:
    """Whether the calibration reads the clock after a run's n-th step."""
    return WARM_STEPS <= n <= WARM_STEPS + CALIBRATION_STEPS and (n - WARM_STEPS) % WINDOW == 0


def schedule_length(marks: list[float], step: int, train_seconds: float, total_minutes: float) -> int:
    """Steps for a schedule spanning total_minutes of training, from train_seconds at the ends of
    consecutive WINDOW-step windows (`marks`): the steps done plus the time left at the median
    window's pace."""
    windows = sorted(b - a for a, b in zip(marks, marks[1:]))
    per_step = max(windows[len(windows) // 2], 1e-9) / WINDOW
    return step + int(max(0.0, total_minutes * 60 - train_seconds) / per_step)


class RunClock:
    def __init__(self, total_steps: int | None, total_minutes: float, max_minutes: float,
                 checkpoint_minutes: float, device: torch.device, distributed: bool):
        self.total_steps = total_steps
        self.total_minutes, self.max_minutes, self.checkpoint_minutes = total_minutes, max_minutes, checkpoint_minutes
        self.device, self.distributed = device, distributed
        self.start = self.last_checkpoint = time.time()
        self.run_steps = 0
        self._marks: list[float] = []  # train_seconds at every WINDOW-th step of the calibration
        # each of a run's first FIRST_STEPS steps, timed alone, and its parts (`phase`): one-time
        # costs (kernel compiles, autotuning, allocator growth) show there and nowhere else (the
        # log reports them)
        self.first_steps: list[float] = []
        self.first_phases: list[dict[str, float]] = []
        self._phases: dict[str, float] = {}

    def _from_rank0(self, value: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            torch.distributed.broadcast(value, 0)
        return value

    def lr(self, step: int, peak: float, warmup: int) -> float:
        return lr_at(step, self.total_steps or 10**9, peak, warmup)

    def timing_step(self) -> bool:
        """Whether the step about to finish is one the calibration times exactly (sync first)."""
        return _calibration_mark(self.run_steps + 1)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a part of the step being run while the run is in its first FIRST_STEPS steps (the
        GPU synchronised around it); later steps run it untimed, without a sync."""
        if len(self.first_steps) >= FIRST_STEPS:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._phases[name] = round(self._phases.get(name, 0.0) + time.time() - t0, 3)

    def step_seconds(self, step: int, t0: float) -> float:
        """Seconds since t0 for the step just finished (step counts it). The GPU is synchronised
        every 10 steps and on the calibration steps, so the training time stays honest without a
        sync per step."""
        first = len(self.first_steps) < FIRST_STEPS
        if self.device.type == "cuda" and (step % 10 == 0 or self.timing_step() or first):
            torch.cuda.synchronize()
        seconds = time.time() - t0
        if first:
            self.first_steps.append(round(seconds, 3))
            self.first_phases.append(self._phases)
            self._phases = {}
        return seconds

    def step_done(self, step: int, train_seconds: float) -> bool:
        """Count a finished step; True when it just fixed the schedule length."""
        self.run_steps += 1
        if self.total_steps is not None:
            return False
        if _calibration_mark(self.run_steps):
            self._marks.append(train_seconds)
        if self.run_steps == WARM_STEPS + CALIBRATION_STEPS:
            self.total_steps = int(self._from_rank0(torch.tensor([schedule_length(
                self._marks, step, train_seconds, self.total_minutes)], device=self.device)).item())
            return True
        return False

    def finished(self, step: int) -> bool:
        return self.total_steps is not None and step >= self.total_steps

    def out_of_time(self) -> bool:
        flag = torch.tensor([time.time() - self.start > self.max_minutes * 60], device=self.device)
        return bool(self._from_rank0(flag).item())  # every rank stops at the same step

    def checkpoint_due(self) -> bool:
        if time.time() - self.last_checkpoint > self.checkpoint_minutes * 60:
            self.last_checkpoint = time.time()
            return True
        return False


def run_steps(clock: RunClock, bar, step: int, train_seconds: float, train_step, after_step, save) -> tuple[int, float]:
    """The step loop the trainers share, from `step` until the schedule ends or the run's time is up.

    train_step(step) takes one optimiser step (step: the steps done before it) and returns what
    after_step(step, train_seconds, result) needs: the trainer's logging and validation, which
    differ. save(step, train_seconds) writes a checkpoint when one is due. Closes the bar;
    returns (step, train_seconds) where the run stopped, for the trainer's end of run."""
    while not clock.finished(step):
        t0 = time.time()
        result = train_step(step)
        step += 1
        train_seconds += clock.step_seconds(step, t0)
        if clock.step_done(step, train_seconds):
            bar.total = clock.total_steps
        bar.update(1)
        after_step(step, train_seconds, result)
        if clock.checkpoint_due():
            save(step, train_seconds)
        if clock.out_of_time():
            break
    bar.close()
    return step, train_seconds


def optimizer_step(opt, params, lr: float, device: torch.device, forward):
    """One optimiser step at learning rate lr: forward() under bf16 autocast on CUDA (it returns
    the loss, or a tuple whose first item is the loss), backward, gradient clipping at 1.0.
    Returns forward's result and the gradient norm."""
    for grp in opt.param_groups:
        grp["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = forward()
    opt.zero_grad(set_to_none=True)
    (out[0] if isinstance(out, tuple) else out).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return out, gnorm


def save_checkpoint(state: dict, path) -> None:
    """torch.save through a temporary file, so a run killed mid-write keeps the previous checkpoint."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_checkpoint(path) -> dict | None:
    """What `save_checkpoint` wrote at path, or None when there is none (a fresh run)."""
    path = Path(path)
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


class TrainingRun:
    """One process's share of a training run: the process group, the run directory, its log
    (`train_log.jsonl`, written by rank 0) and `ckpt.pt`, the step loop and the end of run.

    A trainer opens one, builds its model from `load()` (None: a fresh run), says what it
    trains with `header`, runs `steps` and ends with `close`, which returns the summary."""

    def __init__(self, out_dir, device: str):
        self.t_start = time.time()
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.dev, self.rank, self.world, self.distributed = setup(device)
        self.main = self.rank == 0
        self.ckpt_path = self.out / "ckpt.pt"
        self._log = None
        self.clock: RunClock | None = None
        self.metrics: dict = {}  # the latest validation's (`steps`)

    def load(self) -> dict | None:
        """This run's checkpoint, or None when it starts afresh."""
        return load_checkpoint(self.ckpt_path)

    def record(self, entry: dict, flush: bool = False) -> None:
        """Append one line to the log (rank 0; the others log nothing)."""
        if not self.main:
            return
        if self._log is None:
            self._log = open(self.out / "train_log.jsonl", "a")
        self._log.write(json.dumps(entry) + "\n")
        if flush:
            self._log.flush()

    def header(self, resumed: bool, **entry) -> None:
        """The log's first line, once per run (not again when it resumes)."""
        if not resumed:
            device = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"
            self.record({"event": "start", **entry, "world": self.world, "device": device})

    def save(self, state: dict) -> None:
        if self.main:
            save_checkpoint(state, self.ckpt_path)

    def steps(self, total_steps: int | None, total_minutes: float, max_minutes: float, checkpoint_minutes: float,
              step: int, train_seconds: float, train_step, after_step, save, desc: str, progress: bool,
              validate=None, eval_every: int = 0) -> tuple[int, float]:
        """`run_steps` under a new clock (`self.clock`) and progress bar. validate() (optional)
        returns held-out metrics: taken after every eval_every-th step and at the end of the run,
        logged, the latest kept in `self.metrics`."""
        from tqdm import tqdm

        self.clock = RunClock(total_steps, total_minutes, max_minutes, checkpoint_minutes, self.dev, self.distributed)
        self.bar = tqdm(total=total_steps, initial=step, desc=desc, unit="step", disable=not (progress and self.main))
        validated_at = None

        def validated(step: int, train_seconds: float) -> None:
            nonlocal validated_at
            validated_at = step
            self.metrics = validate()
            self.record({"step": step, **self.metrics, "train_seconds": round(train_seconds, 1)}, flush=True)

        def after(step: int, train_seconds: float, result) -> None:
            after_step(step, train_seconds, result)
            if validate is not None and step % eval_every == 0:
                validated(step, train_seconds)

        step, train_seconds = run_steps(self.clock, self.bar, step, train_seconds, train_step, after, save)
        if validate is not None and validated_at != step:  # every run ends with a validation
            validated(step, train_seconds)
        return step, train_seconds

    def close(self, step: int, train_seconds: float, export, **summary) -> dict:
        """Log the end of the run, export (rank 0: `export()`), leave the process group; the summary."""
        clock = self.clock
        summary = {"step": step, "total_steps": clock.total_steps, "finished": clock.finished(step), **summary,
                   "train_seconds": round(train_seconds, 1), "wall_seconds": round(time.time() - self.t_start, 1),
                   "first_steps_seconds": clock.first_steps, "first_steps_phases": clock.first_phases}
        if self.main:
            self.record({"event": "end_of_run", **summary})
            self._log.close()
            export()
        finish(self.distributed)
        return summary

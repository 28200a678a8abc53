"""Pipeline schedules against one process and against torch.distributed.pipelining, in one invocation.

    python tools/bench_pipeline.py                    # small sizes: a few minutes on a CPU
    python tools/bench_pipeline.py --layers 16 --d-model 256 --micro 16

For pp = 2 and 4 and each schedule (gpipe, 1f1b, interleaved with vpp=2, zb-h1) it spawns pp gloo ranks
(torch.multiprocessing, one CPU thread each) and times forward + backward of one global batch of M micro-batches
on the same GPT: trident's PipelineRunner, then torch.distributed.pipelining's schedule of the same name on the
same stage modules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble with one
stage per rank for zb-h1). The baseline is the whole model in one process (pp=1, one thread). Printed per row:
tokens/s and its ratio to pp=1 and to torch; the measured bubble, idle / step time per rank (worst rank, from
the runner's recorded action timings) beside the formula's (P-1)/(M+P-1) (interleaved: V*M; zb-h1 with the
measured F, I, W costs); for gpipe and 1f1b the first stage's peak bytes of activations saved for backward
(torch.autograd.graph.saved_tensors_hooks, each storage counted once, parameters left out).

On a machine with fewer cores than ranks (pp=4 on 2 cores) the ranks share cores: tokens/s then measures the
schedule's overhead more than its speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.pipeline.executor import PipelineRunner
from trident.parallel.pipeline.schedules import F, I, W, bubble_formula
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.reducer import GradReducer
from trident.parallel.topology import Topology

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}


class SavedBytes:
    """Peak bytes of the tensors autograd keeps for backward, each storage once, parameters left out."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad and t.grad_fn is None and t.dim() > 2):
            return t
        key = t.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Holder) else saved


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _chunks(cfg: ModelConfig, pp: int, vpp: int, rank: int) -> list[GPT]:
    stages = pp * vpp
    out = []
    for c in range(vpp):
        s = c * pp + rank
        chunk = GPT(cfg, layers=stage_layers(cfg.n_layers, pp, vpp, s), first=s == 0, last=s == stages - 1)
        init_weights(chunk, cfg, seed=0)
        out.append(chunk)
    return out


def _batch(cfg: ModelConfig, micro: int, mbs: int, step: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(step)
    shape = (mbs, cfg.seq_len)
    ids = torch.randint(0, cfg.vocab_size, (micro, 2, *shape), generator=gen)
    return [Batch(x, y, torch.arange(m * mbs, (m + 1) * mbs), step) for m, (x, y) in enumerate(ids.unbind(0))]


class _Ours:
    def __init__(self, cfg, args, schedule, pp, vpp, rank, out_dir: Path) -> None:
        groups = build_process_groups(Topology(dp=1, pp=pp, tp=1))
        self.chunks = _chunks(cfg, pp, vpp, rank)
        self.reducer = GradReducer([p for c in self.chunks for p in c.parameters()], groups.dp_group)
        self.timings = out_dir / f"timings-{rank}.jsonl"
        self.runner = PipelineRunner(self.chunks, schedule, rank, groups.pp_ranks, groups.pp_group, self.reducer,
                                     "fp32", cfg.d_model, timings=self.timings)  # fmt: skip
        self.tokens = args.micro * args.mbs * cfg.seq_len

    def step(self, batches) -> None:
        self.runner.forward_backward(batches, lm_loss_sum, 1.0 / self.tokens)
        self.reducer.zero_grad()


class _Torch:
    def __init__(self, cfg, args, schedule, pp, vpp, rank) -> None:
        import torch.distributed.pipelining as pipelining

        group = dist.new_group(list(range(pp)))
        self.chunks = _chunks(cfg, pp, vpp, rank)
        cpu = torch.device("cpu")
        stages = [
            pipelining.PipelineStage(c, i * pp + rank, pp * vpp, cpu, group=group) for i, c in enumerate(self.chunks)
        ]
        tokens = args.micro * args.mbs * cfg.seq_len
        loss_fn = lambda out, y: lm_loss_sum(out, y) / tokens  # noqa: E731
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        self.sched = cls(stages[0] if len(stages) == 1 and schedule != "zb-h1" else stages, args.micro, loss_fn)
        self.rank, self.pp = rank, pp

    def step(self, batches) -> None:
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        kwargs = {"target": y, "losses": []} if self.rank == self.pp - 1 else {}
        self.sched.step(x, **kwargs) if self.rank == 0 else self.sched.step(**kwargs)
        for c in self.chunks:
            c.zero_grad(set_to_none=True)


class _OneProcess:
    """The whole model on rank 0 (the other ranks wait): the pp=1 baseline, timed between the pipelines' steps."""

    def __init__(self, cfg, args, rank) -> None:
        self.model = GPT(cfg) if rank == 0 else None
        if self.model is not None:
            init_weights(self.model, cfg, seed=0)
        self.tokens = args.micro * args.mbs * cfg.seq_len

    def step(self, batches) -> None:
        if self.model is not None:
            for x, y in batches:
                (lm_loss_sum(self.model(x), y) / self.tokens).backward()
            self.model.zero_grad(set_to_none=True)


def _worker(rank: int, pp: int, port: int, job: dict, out_dir: str) -> None:
    """Time the three implementations step by step in turn, so a load that comes and goes hits them alike."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    args, cfg = argparse.Namespace(**job["args"]), ModelConfig(**job["model"])
    schedule, vpp = job["schedule"], job["vpp"]
    result: dict = {}
    try:
        impls = {
            "trident": _Ours(cfg, args, schedule, pp, vpp, rank, Path(out_dir)),
            "one": _OneProcess(cfg, args, rank),
        }
        try:
            impls["torch"] = _Torch(cfg, args, schedule, pp, vpp, rank)
        except Exception as e:  # a schedule torch cannot build for this layout
            result["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:60]
        times: dict[str, list[float]] = {name: [] for name in impls}
        for step in range(args.warmup + args.steps):
            batches = _batch(cfg, args.micro, args.mbs, step)
            for name, impl in impls.items():
                dist.barrier()
                start = time.perf_counter()
                impl.step(batches)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        result.update({name: statistics.median(ts[args.warmup :]) for name, ts in times.items()})
        ours = impls["trident"]
        rows = [json.loads(line) for line in ours.timings.read_text().splitlines()]
        result["spans"] = [r["spans"] for r in rows[args.warmup :]]
        if rank == 0 and schedule in ("gpipe", "1f1b"):
            saved = SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                ours.step(_batch(cfg, args.micro, args.mbs, 0))
            result["peak"] = saved.peak
        else:
            ours.step(_batch(cfg, args.micro, args.mbs, 0))  # every rank runs the same schedule
    finally:
        (Path(out_dir) / f"result-{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(job: dict, pp: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(pp, _free_port(), job, out), nprocs=pp, join=True)
        return [json.loads((Path(out) / f"result-{r}.json").read_text()) for r in range(pp)]


def measured_bubble(spans_per_step: list[list[list]], pp: int) -> tuple[float, dict[str, float]]:
    """Worst rank's idle / step time, median over steps; and the mean duration of each kind of action."""
    fractions, costs = [], {}
    for step in spans_per_step:
        t0 = min(s[3] for rank in step for s in rank)
        t1 = max(s[4] for rank in step for s in rank)
        busy = [sum(s[4] - s[3] for s in rank) for rank in step]
        fractions.append(max((t1 - t0 - b) / (t1 - t0) for b in busy))
        for rank in step:
            for kind, *_, start, end in rank:
                costs.setdefault(kind, []).append(end - start)
    return statistics.median(fractions), {k: statistics.mean(v) for k, v in costs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--mbs", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    model = dict(name="bench", n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=args.seq_len,
                 vocab_size=args.vocab)  # fmt: skip
    tokens = args.micro * args.mbs * args.seq_len
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}; M={args.micro} micro-batches of "
          f"{args.mbs}; {tokens} tokens a step; tokens/s are medians of {args.steps} steps; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")  # fmt: skip
    head = f"{'pp':>2} {'schedule':<12} {'tokens/s':>9} {'pp=1':>9} {'vs pp=1':>7} {'torch':>9} {'vs torch':>8} "
    head += f"{'bubble':>7} {'formula':>7} {'act. peak (stage 0)':>20}"
    print(head)
    for pp in args.pp:
        for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
            vpp = 2 if schedule == "interleaved" else 1
            if args.layers % (pp * vpp):
                continue
            res = _spawn({"args": vars(args), "model": model, "schedule": schedule, "vpp": vpp}, pp)
            ours_tps, base = tokens / res[0]["trident"], tokens / res[0]["one"]
            bubble, costs = measured_bubble([list(step) for step in zip(*(r["spans"] for r in res), strict=True)], pp)
            if schedule == "zb-h1":
                b = bubble_formula(schedule, pp, vpp, args.micro, {"F": costs[F], "I": costs[I], "W": costs[W]})
            else:
                b = bubble_formula(schedule, pp, vpp, args.micro)
            formula = b / (1 + b)  # idle over busy -> idle over the step
            if "torch" in res[0]:
                torch_tps = tokens / res[0]["torch"]
                torch_col, ratio = f"{torch_tps:9,.0f}", f"{ours_tps / torch_tps:7.2f}x"
            else:
                torch_col, ratio = "n/a", res[0]["torch_error"]
            peak = res[0].get("peak")
            mem = f"{peak / 2**20:16.2f} MiB" if peak is not None else ""
            print(f"{pp:>2} {schedule:<12} {ours_tps:9,.0f} {base:9,.0f} {ours_tps / base:6.2f}x {torch_col:>9} "
                  f"{ratio:>8} {bubble:7.3f} {formula:7.3f} {mem:>20}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""The exits a trained case's model leaves by, each checked against the trained model itself (issue 48).

The truth is the case's final checkpoint loaded in one process the way a resume loads it (train.py's parts built
through trident/build.py at world 1 in fp32, ``Checkpointer.maybe_resume``: the parameters from the fp32 masters
and the buffers, the sparse layers' loss-free balancing biases), run on a fixed batch of the dataset (its first
windows, no document mask: every exit computes plain windows). Each exit must compute the same logits:

- consolidated: ``tools/convert_checkpoint.py``'s file (``write_consolidated``), loaded as ``tools/generate.py``
  loads it (its ``build_model``), to ``ATOL``;
- generation: ``tools/generate.py``'s model of the checkpoint directory, its full forward to ``ATOL``, and a
  KV-cache decode (a prompt at once, then each token alone, ``GPT.forward(ids, cache)``) equal to that full
  forward's next-token logits at every position, to ``ATOL``;
- init_from: a fresh model filled by ``checkpoint.init_from`` (train.py's ``load_init_weights`` at world 1) before
  any step, to ``ATOL`` (the run from it under another layout is the runner's curve check);
- Hugging Face: ``write_hf`` loaded by transformers' ``AutoModelForCausalLM``, to ``ATOL`` in fp32, where the
  architecture maps; where export refuses (no class for the block, a bias or capacity the class has no place for),
  the refusal must be one ``CheckpointError`` line naming a ``model.`` key.

Everything runs in the fuzzer's own process (a one-rank gloo group for the truth and init_from), on the fp32
weights whatever the case's precision: the checkpoint holds fp32 masters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import runpy
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from trident.build import build_checkpointer, build_parts
from trident.checkpoint.init_from import check_init_from, load_init_weights
from trident.config import Config, ParallelConfig, validate
from trident.data.dataset import TokenDataset, TokenWindows
from trident.errors import CheckpointError
from trident.models.checkpointing import SELECTIVE_MODULES
from trident.models.gpt import GPT
from trident.models.kv_cache import KVCache
from trident.parallel.groups import ProcessGroups, build_process_groups
from trident.parallel.topology import Topology
from trident_dev.consolidated import ModelWeights, load_weights, write_consolidated
from trident_dev.export import write_hf

ATOL = 1e-5  # fp32 logits of the same weights: the same function, up to the order of a few sums
WINDOWS = 2  # sequences of the fixed batch (a decode carries each its own cache rows and expert counts)
# The decode's last tokens go one at a time after a prompt of the rest at once: single tokens are where a decode
# departs (a capacity counted per call never drops one), and 16 of them cost a quarter of a whole window's.
SINGLE = 16


def fixed_batch(dataset: Path, seq_len: int) -> torch.Tensor:
    """The dataset's first ``WINDOWS`` windows of ``seq_len`` tokens, [WINDOWS, seq_len]."""
    windows = TokenWindows(TokenDataset(dataset).tokens, seq_len, 0, WINDOWS)
    return windows.batch(torch.arange(WINDOWS))[0]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread meanwhile: the sweep's ranks and the other test worker share the cores, and two threads
    of small ops on two busy cores ran a decode twenty times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def one_process_groups() -> Iterator[ProcessGroups]:
    """A one-rank gloo group in this process (as a plain ``python train.py`` has), torn down after."""
    if dist.is_initialized():
        raise RuntimeError("the exits build their one-process model in a process with no process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield build_process_groups(Topology(dp=1, pp=1, tp=1), timeout_s=60)
    finally:
        dist.destroy_process_group()


def one_process_config(cfg: Config, **checkpoint: object) -> Config:
    """``cfg``'s model and batch at world 1 in fp32 (no FP8), one micro-batch a step, no recomputation, with these
    ``checkpoint.*`` keys (a resume path or an init_from source) and nothing saved."""
    train = dataclasses.replace(
        cfg.train,
        micro_batch_size=cfg.train.global_batch_size,
        precision="fp32",
        activation_checkpointing="none",
        recompute_every=1,
        recompute_modules=list(SELECTIVE_MODULES),
        compile=False,
        fp8="off",  # FP8 computes around bf16 activations; the weights it trained are plain ones
    )
    saving = {"resume": "none", "init_from": None, "async_": False, "every": 0} | checkpoint
    return dataclasses.replace(
        cfg, parallel=ParallelConfig(), train=train, checkpoint=dataclasses.replace(cfg.checkpoint, **saving)
    )


class _Resumed:
    """What the checkpointer restores beside the tensors (the trainer's step): kept, not used."""

    step = 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))


@torch.no_grad()
def _logits_of_parts(
    cfg: Config, groups: ProcessGroups, ids: torch.Tensor, prepare: Callable[..., None] | None = None, **kw: object
) -> torch.Tensor:
    layout = validate(cfg, 1)
    parts = build_parts(cfg, layout, groups, torch.device("cpu"), None, **kw)
    try:
        if prepare is not None:
            prepare(parts)
        (model,) = parts.chunks
        return model.eval()(ids).float()
    finally:
        parts.optimizer.remove_hooks()


def trained_logits(cfg: Config, checkpoint: Path, groups: ProcessGroups, ids: torch.Tensor) -> torch.Tensor:
    """The truth: ``checkpoint`` resumed into one process as train.py resumes it, its logits on ``ids``."""
    one = one_process_config(cfg, resume=str(checkpoint))

    def resume(parts: object) -> None:
        checkpointer = build_checkpointer(one, groups, parts, checkpoint.parent, None)
        with contextlib.redirect_stdout(io.StringIO()):  # "resumed from ..."
            if checkpointer.maybe_resume(_Resumed()) is None:
                raise CheckpointError(f"no checkpoint at {checkpoint} to resume")

    return _logits_of_parts(one, groups, ids, resume)


def started_logits(cfg: Config, checkpoint: Path, groups: ProcessGroups, ids: torch.Tensor) -> torch.Tensor:
    """A fresh one-process model started from ``checkpoint`` by ``checkpoint.init_from``, before any step."""
    one = one_process_config(cfg, init_from=str(checkpoint))
    source = check_init_from(one, checkpoint.parent / "unused-run-dir")
    assert source is not None
    return _logits_of_parts(one, groups, ids, load=lambda chunks: load_init_weights(chunks, source))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def _differs(what: str, got: torch.Tensor, want: torch.Tensor, of: str = "the trained model's") -> list[str]:
    gap = _gap(got, want)
    if gap <= ATOL:
        return []
    shape = "" if got.shape == want.shape else f" (shape {list(got.shape)} against {list(want.shape)})"
    flips = int((got.argmax(-1) != want.argmax(-1)).sum()) if got.shape == want.shape else "?"
    return [f"{what}: logits {gap:.2g} from {of}{shape}, {flips} of {want[..., 0].numel()} argmaxes differ"]


@torch.no_grad()
def decode_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """The logits a KV-cache decode gives at every position: all but the last ``SINGLE`` tokens in one call (the
    prompt), then each token alone, as tools/generate.py's ``sample`` feeds them."""
    cache, prompt = KVCache(ids.shape[1]), max(1, ids.shape[1] - SINGLE)
    out = [model(ids[:, :prompt], cache)]
    out += [model(ids[:, t : t + 1], cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1).float()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


class Exits:
    """The exit checks of a sweep: ``tools/generate.py``'s loader read once from the checkout, transformers
    imported at the first export that loads."""

    def __init__(self, repo: Path, dataset: Path, work_dir: Path) -> None:
        self.dataset = dataset
        self.work_dir = work_dir
        self.build_model = runpy.run_path(str(repo / "tools" / "generate.py"))["build_model"]
        self._count = 0

    def problems(self, cfg: Config, checkpoint: Path) -> list[str]:
        """Every exit of the model ``cfg`` trained into ``checkpoint``, against the checkpoint resumed."""
        self._count += 1
        out = self.work_dir / f"exits{self._count:05d}"
        ids = fixed_batch(self.dataset, cfg.model.seq_len)
        with one_thread(), one_process_groups() as groups:
            try:
                truth = trained_logits(cfg, checkpoint, groups, ids)
            except Exception as e:
                return [f"exits: the checkpoint resumed in one process failed: {_first_line(e)}"]
            checks: list[tuple[str, Callable[[], list[str]]]] = [
                ("consolidated", lambda: self.consolidated(checkpoint, out / "model.safetensors", ids, truth)),
                ("generation", lambda: self.generation(checkpoint, ids, truth)),
                ("init_from", lambda: _differs("exit init_from", started_logits(cfg, checkpoint, groups, ids), truth)),
                ("hf", lambda: self.hugging_face(checkpoint, out / "hf", ids, truth)),
            ]
            problems = []
            for name, check in checks:
                try:
                    problems += check()
                except Exception as e:
                    problems.append(f"exit {name}: failed: {_first_line(e)}")
        return problems

    def consolidated(self, checkpoint: Path, file: Path, ids: torch.Tensor, truth: torch.Tensor) -> list[str]:
        write_consolidated(load_weights(checkpoint), file)
        return self.weights_problems("exit consolidated", load_weights(file), ids, truth)

    @torch.no_grad()
    def weights_problems(self, what: str, weights: ModelWeights, ids: torch.Tensor, truth: torch.Tensor) -> list[str]:
        """``weights`` as tools/generate.py builds a model of them, against the truth's logits."""
        model = self.build_model(weights, torch.device("cpu"))
        return _differs(what, model(ids).float(), truth)

    @torch.no_grad()
    def generation(self, checkpoint: Path, ids: torch.Tensor, truth: torch.Tensor) -> list[str]:
        model = self.build_model(load_weights(checkpoint), torch.device("cpu"))
        full = model(ids).float()
        decoded = decode_logits(model, ids)
        problems = _differs("exit generation (tools/generate.py's model)", full, truth)
        return problems + _differs("exit generation (KV-cache decode)", decoded, full, "its full forward's")

    @torch.no_grad()
    def hugging_face(self, checkpoint: Path, out: Path, ids: torch.Tensor, truth: torch.Tensor) -> list[str]:
        try:
            write_hf(load_weights(checkpoint), out)
        except CheckpointError as e:  # no class for this model: the refusal is the check
            line = str(e)
            if "\n" in line or not re.search(r"\bmodel\.[a-z_]+(\.[a-z_]+)?\b", line):
                return [f"exit hf: the refusal is not one line naming a model key: {line!r}"]
            return []
        import transformers  # a second or more to import: only where an export loads

        # The experts' eager loop: transformers' default grouped_mm on a CPU fails in torch's kernel ("strides should
        # be multiple of 16 bytes") at an expert width whose rows are not (d_expert 30 in fp32), which transformers
        # checks only up to torch 2.10 (docs/checkpoints.md says so to users).
        with contextlib.redirect_stderr(io.StringIO()):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                out, dtype=torch.float32, experts_implementation="eager"
            ).eval()
        return _differs(f"exit hf ({type(model).__name__})", model(ids).logits.float(), truth)


def export_class(cfg: Config) -> str | None:
    """The Hugging Face class ``cfg``'s model exports as, or None where export refuses it: no class for its block
    (trident/checkpoint/hf.py's ``architecture``), or experts with state no class has a place for (a capacity: every
    Hugging Face MoE is dropless; a loss-free balancing bias, which moves when ``bias_update_rate`` > 0). What a
    case's export exercises, for the cover (trident_dev/fuzz/cover.py)."""
    from trident.checkpoint.hf import architecture

    moe = cfg.model.moe
    if moe.enabled and (moe.capacity_factor is not None or moe.bias_update_rate > 0):
        return None
    try:
        return architecture(cfg.model)
    except CheckpointError:
        return None

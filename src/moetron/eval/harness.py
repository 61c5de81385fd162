"""lm-evaluation-harness on a moetron checkpoint: the `moetron` model of lm-eval (an `lm_eval.api.model.LM`).

    lm = MoetronLM(load="runs/moe", batch_size=8)                  # one process, or every rank under torchrun
    lm_eval.simple_evaluate(model=lm, tasks=["moetron_tiny"], task_manager=TaskManager(include_path=TASKS_DIR))

It scores exactly what lm-eval's own `hf` model scores on the exported checkpoint (`TemplateLM`'s pair encoding,
the same left truncation to the model's position limit, log-softmax over the tokenizer's vocabulary), batched by
length (longest first, right-padded: causal attention and per-token routing make padding invisible), and generates
greedily (or sampling when a task asks) with the KV cache, `generate_texts`-style: contexts of one token length share
their forward passes.

Under torchrun the checkpoint is loaded at the run's layout (`--expert-parallel-size`, default: the largest the
experts allow over all ranks): each rank holds E / ep experts, lm-eval splits the requests over the data-parallel
ranks, and tokens reach their experts by all-to-all. A rank's forward passes pair up with every other rank's, so
before each one all ranks agree (one all-reduce of a flag) that someone still has work; a rank with none runs a
one-token dummy forward to take part in the all-to-alls until everyone is done. Routing is dropless by default
(as Megatron-DeepSpeed's `ds_evalharness.sh` runs with --disable-moe-token-dropping), so a token's scores never
depend on the batch it landed in; `capacity_factor` routes at that factor instead.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import tasks as lm_eval_tasks
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moetron.errors import UserError
from moetron.eval.generate import filter_logits, inference_routing
from moetron.model.kv_cache import KVCache
from moetron.progress import Progress

TASKS_DIR = Path(__file__).parent / "tasks"


def load_for_evaluation(
    load: str, expert_parallel_size: int | None, device: torch.device | None, tokenizer_overrides: dict | None = None
):
    """(model in eval mode holding this rank's experts, run config, DistEnv, ParallelMesh, tokenizer).

    `tokenizer_overrides` ({field: path} from --vocab-file/--merge-file/--tokenizer-model) replace the tokenizer
    the checkpoint's config names, checked (files exist, fit the vocabulary) before the process group or weights."""
    from moetron.checkpoint.open import open_run
    from moetron.parallel.dims import ParallelDims
    from moetron.parallel.env import init_distributed
    from moetron.parallel.mesh import ParallelMesh

    run = open_run(load, tokenizer_overrides=tokenizer_overrides)
    cfg, tokenizer = run.cfg, run.tokenizer
    env = init_distributed(cfg.parallel.distributed_backend)
    ep = expert_parallel_size or _largest_ep(cfg.model.experts_per_layer(), env.world_size)
    dims = ParallelDims(world_size=env.world_size, dp=env.world_size, ep=ep)
    problems = dims.problems(cfg.model.experts_per_layer())
    if problems:
        raise UserError("; ".join(problems))
    mesh = ParallelMesh.build(dims, env)
    return run.model(device or env.device, mesh), cfg, env, mesh, tokenizer


def _largest_ep(experts_per_layer: list[int], world: int) -> int:
    counts = [e for e in experts_per_layer if e > 1]
    return max((ep for ep in range(1, world + 1) if world % ep == 0 and all(e % ep == 0 for e in counts)), default=1)


@register_model("moetron")
class MoetronLM(TemplateLM):
    """`lm_eval --model moetron --model_args load=runs/moe,batch_size=8` (after `import moetron.eval.harness`)."""

    def __init__(
        self,
        load: str,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        capacity_factor: float | None = None,
        expert_parallel_size: int | None = None,
        max_length: int | None = None,
        seed: int = 1234,
        tokenizer_overrides: dict | None = None,
        **_,
    ):
        super().__init__()
        self.model, self.cfg, self.env, self.mesh, self.tokenizer_ = load_for_evaluation(
            load, expert_parallel_size and int(expert_parallel_size), None, tokenizer_overrides
        )
        self.batch_size_ = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.capacity_factor = None if capacity_factor in (None, "None") else float(capacity_factor)
        self._max_length = int(max_length) if max_length else self.cfg.model.max_positions
        self.vocab = self.cfg.model.vocab_size
        self.seed = int(seed)
        self._rank, self._world_size = self.mesh.coords.dp, self.mesh.size("dp")
        self.device_ = next(self.model.parameters()).device
        self.synced = self.env.distributed and self.mesh.size("ep") > 1  # forwards hold all-to-alls: pair them

    # ------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self.device_

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer_.encode(string)  # moetron's tokenizers add no special tokens (GPT-2's do not either)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_.decode(tokens)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.env.distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.env.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if not self.env.distributed:
            return [obj]
        out = [None] * self.env.world_size if self.env.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        self.env.barrier()

    # ------------------------------------------------------------ forward passes, in step with the other ranks
    def _someone_working(self, working: bool) -> bool:
        flag = torch.tensor([int(working)], device=self.device_)
        torch.distributed.all_reduce(flag)
        return bool(flag.item())

    @torch.no_grad()
    def _forward(self, tokens_BT: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """fp32 logits over the tokenizer's vocabulary [B, T, V]."""
        if self.synced:
            self._someone_working(True)
        with inference_routing(self.model, tokens_BT.numel(), self.capacity_factor):
            return self.model(tokens_BT.to(self.device_), kv_cache=kv_cache).logits[..., : self.vocab].float()

    @torch.no_grad()
    def _drain(self) -> None:
        """Take part in the other ranks' remaining forward passes (one dummy token each) until all are done."""
        while self.synced and self._someone_working(False):
            with inference_routing(self.model, 1, None):
                self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device_))

    # ------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # its tokenizing bar: our progress lines say it

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Each (context_enc, continuation_enc): Σ log p(continuation | context), and whether it is the greedy one."""
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        progress = Progress("eval-harness loglikelihood", len(requests), "requests")  # rank 0, stderr
        for start in range(0, len(order), self.batch_size_):
            batch = order[start : start + self.batch_size_]
            width = len(inputs[batch[0]])
            padded = [inputs[i] + [self.eot_token_id] * (width - len(inputs[i])) for i in batch]
            logprobs_BTV = F.log_softmax(self._forward(torch.tensor(padded)), dim=-1).cpu()
            for row, i in enumerate(batch):
                cont = requests[i][2]
                end = len(inputs[i])
                scores_NV = logprobs_BTV[row, end - len(cont) : end]
                target_N = torch.tensor(cont)
                greedy = bool((scores_NV.argmax(-1) == target_N).all())
                results[i] = (float(scores_NV.gather(1, target_N[:, None]).sum()), greedy)
            progress.advance(len(batch))
        progress.close()
        self._drain()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of the model's length (lm-eval's rolling windows)."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    # ------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id])
        jobs: dict[tuple, list[tuple[int, list[int]]]] = {}
        settings = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            key = (len(ids), max_new, tuple(until), repr(sorted(kwargs.items())))
            settings[key] = (until, max_new, kwargs)
            jobs.setdefault(key, []).append((index, ids))
        out: list[str] = [""] * len(requests)
        progress = Progress("eval-harness generate_until", len(requests), "requests")  # rank 0, stderr
        for key, group in jobs.items():
            until, max_new, kwargs = settings[key]
            for start in range(0, len(group), self.batch_size_):
                batch = group[start : start + self.batch_size_]
                for (index, _), text in zip(
                    batch, self._generate([ids for _, ids in batch], until, max_new, kwargs), strict=True
                ):
                    out[index] = text
                progress.advance(len(batch))
        progress.close()
        self._drain()
        return out

    def _generate(self, prompts: list[list[int]], until: list[str], max_new: int, kwargs: dict) -> list[str]:
        """Equal-length prompts decoded together with the KV cache; each text cut at its first stop sequence."""
        batch, length = len(prompts), len(prompts[0])
        cache = KVCache.for_model(self.cfg.model, batch, length + max_new, self.device_)
        generator = torch.Generator().manual_seed(self.seed)
        tokens_BT = torch.tensor(prompts)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * batch
        for _ in range(max_new):
            logits_BV = self._forward(tokens_BT, cache)[:, -1].cpu()
            step = self._next_tokens(logits_BV, kwargs, generator)
            for b, token in enumerate(step):
                if not done[b]:
                    new[b].append(token)
                    text = self.tok_decode(new[b])
                    done[b] = token == self.eot_token_id or any(stop and stop in text for stop in until)
            if all(done):
                break
            tokens_BT = torch.tensor([[token] for token in step])
        texts = []
        for ids in new:
            text = self.tok_decode(ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts

    @staticmethod
    def _next_tokens(logits_BV: torch.Tensor, kwargs: dict, generator: torch.Generator) -> list[int]:
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not kwargs.get("do_sample", False) or temperature == 0.0:
            return logits_BV.argmax(-1).tolist()
        tokens = []
        for logits_V in logits_BV:
            filtered = filter_logits(
                logits_V / temperature, int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0))
            )
            tokens.append(int(torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator)))
        return tokens


class TaskManager(lm_eval_tasks.TaskManager):
    """lm-eval's task index, whose tasks' data that cannot be read here is one line naming the task (lm-eval's
    own tasks download theirs from the hub: a ConnectionError deep in `datasets` on a machine without network)."""

    def load(self, task_list):
        try:
            return super().load(task_list)
        except OSError as err:  # ConnectionError, datasets' DatasetNotFoundError (a FileNotFoundError), …
            names = [task_list] if isinstance(task_list, str) else list(task_list)
            task = next((t for t in names if not self._loads(t)), ", ".join(map(str, names)))
            raise UserError(unreadable_data(task, err)) from None

    def _loads(self, task) -> bool:
        try:
            super().load([task])
        except OSError:
            return False
        return True


def unreadable_data(task: str, err: OSError) -> str:
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"--tasks {task}: its data cannot be read here ({why}); a task of lm-eval's downloads its data, which needs "
        f"network (run it once on a machine online with HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0: the HF datasets "
        f"cache keeps it), or run a local task: moetron_tiny, or your YAML + JSONL with --include-path DIR"
    )


@contextlib.contextmanager
def offline_hub():
    """No hub is reachable from the machines this runs on: tasks read local files (HF_*_OFFLINE=1 unless set)."""
    import os

    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    for key, value in saved.items():
        if value is None:
            os.environ[key] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


class _DropKnownNotes(logging.Filter):
    """lm-eval's note on every task whose data a Python function builds (moetron's shipped tasks do): not the
    user's concern."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval without its noise: `git describe` run in the user's directory (its "fatal: not a git repository"
    on stderr: a results field only) and the custom-dataset note. Everything else it says still shows."""
    import subprocess

    import lm_eval.evaluator as evaluator

    def git_hash() -> str | None:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
        return done.stdout.strip() or None

    saved = getattr(evaluator, "get_git_commit_hash", None)
    quiet = _DropKnownNotes()
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm_eval.api.task")]
    if saved is not None:  # an lm-eval without it asks no git: nothing to quieten
        evaluator.get_git_commit_hash = git_hash
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        if saved is not None:
            evaluator.get_git_commit_hash = saved
        for logger in loggers:
            logger.removeFilter(quiet)


def evaluate_harness(
    load: str,
    tasks: list[str],
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: list[str] | None = None,
    log_samples: bool = False,
    seed: int = 1234,
    **model_args,
) -> tuple[dict | None, MoetronLM]:
    """lm-eval's `simple_evaluate` on the checkpoint: (results on global rank 0, None elsewhere; the model).

    The tasks shipped with moetron (`moetron/eval/tasks/`) are always on the include path."""
    import lm_eval

    with offline_hub(), quiet_lm_eval():
        lm = MoetronLM(load, seed=seed, **model_args)
        paths = [str(TASKS_DIR), *(include_path or [])]
        manager = TaskManager(include_path=paths, include_defaults=False)  # local tasks: no scan of lm-eval's ~10k
        if any(t not in manager.all_tasks for t in tasks):
            manager = TaskManager(include_path=paths)  # one of lm-eval's own tasks (its data must be local too)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise UserError(
                f"--tasks: {', '.join(unknown)} not found (shipped: moetron_tiny; add --include-path DIR "
                f"for your own YAML tasks)"
            )
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            bootstrap_iters=0,
        )
    return results, lm

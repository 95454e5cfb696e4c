"""One-GPU check of the VeRL top-K path: vLLM rollout (logprobs=20) -> support -> every method's loss -> mask stats.

For a real cluster node: needs a CUDA GPU, vllm, and a small causal LM on local disk (``--model PATH``, e.g.
Qwen3-0.6B-Base; nothing is fetched from the hub); well under 5 minutes. It exercises the pieces the VeRL
plugin uses on the cluster (vLLM's real logprobs parsed into records, the packed alignment and support gather
on a transformers forward of the same model, GRPO advantages, every method's loss) without importing verl, and
prints per method the loss and mask metrics and the largest gap between the sampled token's log-prob from the
support gather and from a direct log-softmax of the same logits (the alignment check).

    python scripts/gpu_check.py --model PATH [--attn-implementation flash_attention_2|sdpa] [--k 20] [--prompts 8]
                                [--samples 4] [--max-tokens 256]

First it checks the node itself, as the cluster's jobs will need it: the NVIDIA driver is new enough for the CUDA
build of torch (``MIN_DRIVER``, read from ``nvidia-smi``) and the attention the cluster config asks for imports
(``--attn-implementation``, default conf/cluster/h20_4x8.yaml's ``attn_implementation``: flash_attention_2 needs
flash_attn); the training forward then loads the model with that attention.

Exit status: 0 when every gradient is finite and both checks hold (``PI_SAMPLED_GAP_MAX``,
``STEP0_DIVERGENCE_MEAN_MAX``), 1 with one line naming what failed, 2 when the machine (driver, attention module,
no GPU) or the model path cannot run the check, one line naming every such problem. All but :func:`rollout` and
:func:`training_logits` is tested on CPU (tests/verl/test_verl_gpu_check.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from predmask import METHODS, MethodParams, policy_loss
from predmask.config import group_entry
from predmask.metrics import (
    CLIPFRAC,
    MASK_DIRECTION_DISAGREE,
    MASK_DIVERGENCE_MAX,
    MASK_DIVERGENCE_MEAN,
    MASK_MU_TAIL_CLAMPED,
    MASK_OUTSIDE_FRAC,
    MASK_PI_SAMPLED_GAP,
    MASK_PI_TAIL_CLAMPED,
    PPO_KL,
)
from predmask.rl.algo import grpo_advantages
from predmask.rundir import first_line
from predmask.schemas.cluster_schema import ATTENTION_MODULES
from predmask.support import TopKSupport
from predmask.verl.gather import chunked_support_logprobs
from predmask.verl.packing import pack_response_tensor, packed_response_index, support_from_records
from predmask.verl.records import TopKRecord, parse_vllm_logprobs

#: (prompt, answer): short math questions whose answer a small base model sometimes gets right
PROMPTS: tuple[tuple[str, str], ...] = (
    ("What is the sum of the first 100 positive integers? Answer:", "5050"),
    ("A rectangle has sides 6 and 8. What is the length of its diagonal? Answer:", "10"),
    ("How many prime numbers are less than 30? Answer:", "10"),
    ("Solve for x: 2x + 7 = 31. Answer:", "12"),
    ("What is 15% of 240? Answer:", "36"),
    ("How many edges does an octahedron have? Answer:", "12"),
    ("What is the greatest common divisor of 84 and 126? Answer:", "42"),
    ("How many ways can 4 people sit in a row? Answer:", "24"),
)


#: largest gap (nats) allowed between the sampled token's log-prob from the support gather and from a direct
#: log-softmax: both are float32 log-softmaxes of the same logits row, so they differ only by float32 rounding
#: (about 1e-5 at Qwen3's vocabulary), while a support scattered to other rows than the ones the sampled token is
#: read from (an off-by-one between the packed alignment's two index routes) gives gaps of order 1
PI_SAMPLED_GAP_MAX = 1e-3
#: largest mean top-K KL D(mu, pi) over response tokens allowed at step 0 (the DPPO-TopK-KL row): vLLM and the
#: training forward hold the same weights, so D measures only the two engines' bf16 numerics, while a setup
#: mismatch (another temperature, logprobs mode, tokenizer or model revision, a misaligned support) is
#: expected to give mean D of order 0.1 or more. Not yet calibrated on a device.
STEP0_DIVERGENCE_MEAN_MAX = 0.01
#: the method whose row carries the step-0 divergence (top-K KL, the same D for every KL method on the top-K support)
DIVERGENCE_ROW = "dppo_topk_kl"
#: the oldest NVIDIA driver (Linux) that runs builds of each CUDA major release, by CUDA minor version compatibility
#: (NVIDIA, "CUDA Compatibility", Minor Version Compatibility: 13.x >= 580, 12.x >= 525, 11.x >= 450; the CUDA
#: release notes give 12.x 525.60.13 and 11.x 450.80.02). torch 2.11.0 from PyPI, vLLM 0.24's pin, is a CUDA 13 build.
MIN_DRIVER: dict[int, tuple[int, ...]] = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580,)}
#: the cluster config whose ``attn_implementation`` is the default of --attn-implementation
CLUSTER = "h20_4x8"


#: the columns :func:`print_rows` shows (without their ``actor/...`` prefix)
PRINTED: tuple[str, ...] = (
    "method", "loss", CLIPFRAC, MASK_OUTSIDE_FRAC, MASK_DIVERGENCE_MEAN, MASK_DIVERGENCE_MAX, MASK_DIRECTION_DISAGREE,
    MASK_MU_TAIL_CLAMPED, MASK_PI_TAIL_CLAMPED, PPO_KL, MASK_PI_SAMPLED_GAP, "grad_finite",
)


@dataclass(frozen=True)
class CheckBatch:
    """A rollout batch, response-aligned [B, L(, S)], with the training side gathered on the support."""

    support: TopKSupport
    anchor: Tensor  # log mu_k [B, L]
    pi_logprobs: Tensor  # [B, L, S]
    pi_tail_sq: Tensor  # [B, L]
    log_prob: Tensor  # log pi_k from a direct log-softmax [B, L]
    response_mask: Tensor  # [B, L]
    advantages: Tensor  # [B, L]
    vocab_size: int


def records_from_outputs(outputs: Sequence[Any], k: int) -> tuple[list[list[int]], list[TopKRecord], list[str]]:
    """(prompt token ids, record, text) per completion from vLLM ``RequestOutput``s (``prompt_token_ids``,
    ``outputs[i].token_ids``, ``outputs[i].logprobs``, ``outputs[i].text``)."""
    prompts, records, texts = [], [], []
    for request in outputs:
        for completion in request.outputs:
            prompts.append(list(request.prompt_token_ids))
            records.append(parse_vllm_logprobs(completion.logprobs, list(completion.token_ids), k))
            texts.append(str(getattr(completion, "text", "")))
    return prompts, records, texts


def rewards_for(texts: Sequence[str], answers: Sequence[str]) -> Tensor:
    """+1 when the first line of a response contains the expected answer, else -1."""
    first_lines = [t.strip().splitlines()[0] if t.strip() else "" for t in texts]
    return torch.tensor([1.0 if a in line.replace(",", "") else -1.0 for line, a in zip(first_lines, answers, strict=True)])


def build_batch(
    prompts: Sequence[Sequence[int]],
    records: Sequence[TopKRecord],
    logits_fn: Callable[[list[int]], Tensor],
    rewards: Tensor,
    *,
    group: int,
    temperature: float = 1.0,
) -> CheckBatch:
    """Gather the training log-probs on each rollout support through the plugin's packed alignment.

    ``logits_fn(prompt + response ids)`` returns that sequence's logits [T, V]; the sequences are packed like
    verl's no-padding stream and the support is scattered to the rows that predict each response token.
    """
    b = len(records)
    width = max(r.length for r in records)
    responses = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, rec in enumerate(records):
        responses[i, : rec.length] = torch.as_tensor(rec.token_ids, dtype=torch.long)
        mask[i, : rec.length] = 1
    support, anchor = support_from_records(records, responses, mask)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    response_lens = torch.tensor([r.length for r in records])
    logits = torch.cat([logits_fn(list(p) + r.token_ids.tolist()) for p, r in zip(prompts, records, strict=True)])
    ids = pack_response_tensor(support.ids, prompt_lens, response_lens, fill=0).to(logits.device)
    valid = pack_response_tensor(support.valid, prompt_lens, response_lens, fill=False).to(logits.device)
    pi_packed, tail_packed = chunked_support_logprobs(logits, ids, valid, temperature=temperature, return_tail_sq=True)
    # back to response alignment, and the direct log-softmax of the sampled token for the alignment check
    rows, bidx, pidx = packed_response_index(prompt_lens, response_lens)
    pi = torch.full(support.ids.shape, float("-inf"))
    tail = torch.zeros(b, width)
    log_prob = torch.zeros(b, width)
    pi[bidx, pidx] = pi_packed[rows].cpu()
    tail[bidx, pidx] = tail_packed[rows].cpu()  # type: ignore[index]
    sampled = responses[bidx, pidx].to(logits.device)
    log_prob[bidx, pidx] = torch.log_softmax(logits[rows.to(logits.device)].float() / temperature, -1).gather(
        -1, sampled.unsqueeze(-1)).squeeze(-1).cpu()
    pi = torch.where(support.valid, pi, torch.full_like(pi, float("-inf")))
    adv = grpo_advantages(rewards.float(), group).unsqueeze(-1).expand(b, width) * mask
    return CheckBatch(support, anchor, pi, tail, log_prob, mask, adv.contiguous(), int(logits.shape[-1]))


def method_rows(batch: CheckBatch, delta: float) -> list[dict[str, float | str]]:
    """Every method's loss and metrics on the batch (anchored on the rollout), keyed by metric name plus
    ``method``, ``loss`` and ``grad_finite``."""
    rows: list[dict[str, float | str]] = []
    mask = batch.response_mask.bool()
    gap = (batch.support.sampled_logprob(batch.pi_logprobs) - batch.log_prob).abs()[mask]
    for name, method in METHODS.items():
        params = MethodParams(delta=delta, vocab_size=batch.vocab_size)
        kwargs: dict[str, Any] = {}
        if method.needs_support:
            kwargs = {"mu_logprobs": batch.support.mu_logprobs, "pi_logprobs": batch.pi_logprobs,
                      "valid": batch.support.valid, "sampled_index": batch.support.sampled_index,
                      "pi_tail_sq": batch.pi_tail_sq}
        log_prob = batch.log_prob.clone().requires_grad_(True)
        loss, metrics = policy_loss(method, log_prob=log_prob, old_log_prob=batch.anchor, advantages=batch.advantages,
                                    response_mask=batch.response_mask, params=params, **kwargs)
        loss.backward()
        grad_ok = log_prob.grad is not None and bool(torch.isfinite(log_prob.grad).all())
        row: dict[str, float | str] = {"method": name, "loss": float(loss.detach()), "grad_finite": float(grad_ok)}
        row.update({k: float(v) for k, v in metrics.items()})
        row[MASK_PI_SAMPLED_GAP] = float(gap.max()) if gap.numel() else 0.0
        rows.append(row)
    return rows


def print_rows(rows: Sequence[dict[str, float | str]], width: int | None = None) -> None:
    """A rich table of :func:`method_rows` (``width``: the console's, default the terminal's)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="predmask methods on a vLLM top-K rollout")
    for c in PRINTED:
        table.add_column(c.rsplit("/", 1)[-1])
    for row in rows:
        table.add_row(*[(f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "-"))) for c in PRINTED])
    Console(width=width).print(table)


def check_failures(rows: Sequence[dict[str, float | str]]) -> list[str]:
    """What fails the check in :func:`method_rows`' output, one phrase each (empty: the check passes)."""
    failures = [f"{row['method']}: non-finite gradient" for row in rows if row["grad_finite"] != 1.0]
    gap = max(float(row[MASK_PI_SAMPLED_GAP]) for row in rows)
    if not gap <= PI_SAMPLED_GAP_MAX:
        failures.append(f"{MASK_PI_SAMPLED_GAP} {gap:.3g} > PI_SAMPLED_GAP_MAX {PI_SAMPLED_GAP_MAX} (the support "
                        "is not aligned with the training logits)")
    d = float(next(row for row in rows if row["method"] == DIVERGENCE_ROW)[MASK_DIVERGENCE_MEAN])
    if not d <= STEP0_DIVERGENCE_MEAN_MAX:
        failures.append(f"step-0 {MASK_DIVERGENCE_MEAN} {d:.3g} > STEP0_DIVERGENCE_MEAN_MAX "
                        f"{STEP0_DIVERGENCE_MEAN_MAX} (vLLM and training disagree beyond bf16 numerics)")
    return failures


def model_problem(model: str) -> str | None:
    """None when ``model`` is a local model directory (with config.json), else one line saying why not."""
    path = Path(model)
    if not path.is_dir():
        return f"gpu_check: --model {model}: no such directory (give a local path; nothing is downloaded)"
    if not (path / "config.json").is_file():
        return f"gpu_check: --model {model}: no config.json there (expected a transformers model directory)"
    return None


def driver_version() -> str | None:
    """The NVIDIA driver version of this node (``nvidia-smi``'s, its first GPU), None when nvidia-smi is not there
    or says nothing."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return lines[0] if lines else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def driver_problem(cuda: str | None, driver: str | None) -> str | None:
    """Why the NVIDIA ``driver`` cannot run torch's CUDA build ``cuda`` (``torch.version.cuda``), else None; None
    also when the driver is unknown (no nvidia-smi: the GPU check says what is missing)."""
    if driver is None:
        return None
    if cuda is None:
        return f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): install the CUDA build"
    try:
        major, have = int(cuda.split(".")[0]), _version(driver)
    except ValueError:
        return f"cannot compare NVIDIA driver {driver!r} with torch's CUDA {cuda!r}"
    if major not in MIN_DRIVER:
        return f"torch is built for CUDA {cuda}, for which gpu_check knows no minimum driver (MIN_DRIVER)"
    need = MIN_DRIVER[major]
    if have < need:
        return (f"NVIDIA driver {driver} is older than CUDA {major}.x needs (>= {'.'.join(map(str, need))}) for torch "
                f"{torch.__version__} (CUDA {cuda}): update the driver or use a torch built for an older CUDA")
    return None


def attention_problem(attn_implementation: str) -> str | None:
    """Why the attention ``attn_implementation`` cannot load a model on this node (its module, ATTENTION_MODULES,
    does not import), else None."""
    if attn_implementation not in ATTENTION_MODULES:
        return f"unknown attn_implementation {attn_implementation!r}; allowed: {', '.join(ATTENTION_MODULES)}"
    module = ATTENTION_MODULES[attn_implementation]
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 -- an ImportError, or a broken build's OSError / RuntimeError
        return (f"attn_implementation {attn_implementation} needs {module}, which does not import "
                f"({first_line(exc, typed=True)}): install flash-attn (verl[fsdp] pins 2.8.3) or set "
                "cluster.attn_implementation=sdpa")
    return None


def node_problems(attn_implementation: str, *, cuda: str | None, driver: str | None, gpu: bool) -> list[str]:
    """What stops this node from running the check and the cluster's jobs, one phrase each (empty: nothing):
    the driver against torch's CUDA build ``cuda``, whether a CUDA ``gpu`` is visible, the attention's module."""
    found = [driver_problem(cuda, driver), None if gpu else "no CUDA GPU visible", attention_problem(attn_implementation)]
    return [p for p in found if p is not None]


def cluster_attention(cluster: str = CLUSTER) -> str:
    """The ``attn_implementation`` of conf/cluster/<cluster>.yaml."""
    return str(group_entry("cluster", cluster)["attn_implementation"])


def rollout(model: str, prompts: Sequence[str], *, k: int, samples: int, max_tokens: int, seed: int) -> list[Any]:
    """vLLM generation with ``logprobs=k`` (GPU)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.4, max_logprobs=max(k, 20), seed=seed,
              enforce_eager=True)
    params = SamplingParams(n=samples, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=k, seed=seed)
    outputs = llm.generate(list(prompts), params)
    del llm
    torch.cuda.empty_cache()
    return outputs


def training_logits(model: str, attn_implementation: str) -> Callable[[list[int]], Tensor]:
    """A transformers forward of ``model`` on the GPU, loaded with ``attn_implementation`` as the cluster's verl jobs
    load it, returning per-sequence logits [T, V] (float32)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, local_files_only=True,
                                               attn_implementation=attn_implementation).cuda().eval()

    @torch.no_grad()
    def logits_fn(ids: list[int]) -> Tensor:
        x = torch.tensor([ids], device="cuda")
        return net(input_ids=x).logits[0].float()

    return logits_fn


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local directory of a transformers causal LM")
    parser.add_argument("--attn-implementation", choices=list(ATTENTION_MODULES), default=cluster_attention(),
                        help="the attention to check and load the model with (default: conf/cluster/"
                             f"{CLUSTER}.yaml's attn_implementation, %(default)s)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--delta", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = model_problem(args.model)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    problems = node_problems(args.attn_implementation, cuda=torch.version.cuda, driver=driver_version(),
                             gpu=torch.cuda.is_available())
    if problems:
        print(f"gpu_check: {'; '.join(problems)}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model only: never reach the hub
    start = time.time()
    questions = PROMPTS[: args.prompts]
    outputs = rollout(args.model, [q for q, _ in questions], k=args.k, samples=args.samples,
                      max_tokens=args.max_tokens, seed=args.seed)
    prompts, records, texts = records_from_outputs(outputs, args.k)
    print(f"rollout: {len(records)} samples, {sum(r.length for r in records)} tokens, {time.time() - start:.1f}s")
    rewards = rewards_for(texts, [a for _, a in questions for _ in range(args.samples)])
    batch = build_batch(prompts, records, training_logits(args.model, args.attn_implementation), rewards,
                        group=args.samples)
    rows = method_rows(batch, args.delta)
    print_rows(rows)
    failures = check_failures(rows)
    print(f"total {time.time() - start:.1f}s")
    if failures:
        print(f"gpu_check: FAIL: {'; '.join(failures)}", file=sys.stderr)
        return 1
    print(f"gpu_check: PASS ({MASK_PI_SAMPLED_GAP} <= {PI_SAMPLED_GAP_MAX}, step-0 {MASK_DIVERGENCE_MEAN} <= "
          f"{STEP0_DIVERGENCE_MEAN_MAX}, gradients finite; driver {driver_version()}, torch CUDA {torch.version.cuda}, "
          f"attention {args.attn_implementation})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

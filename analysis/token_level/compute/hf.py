"""The token-level study's GPU path: a Hugging Face causal-LM checkpoint, rollouts through vLLM or transformers.

Both report the top-K of mu, the distribution each token was sampled from: vLLM built with
``logprobs_mode="processed_logprobs"`` (up to K+1 log-probs per position, the sampled token always included),
or ``model.generate`` on a rollout copy of the policy in the precision's dtype (``make_rollout_model``), top-k
and top-p disabled. Prompts are the arithmetic task's rendered through ``prompt_template``; rewards are its
1/0 boxed-answer reward on the decoded response. The transformers path runs on CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from predmask.precisions import Precision
from predmask.rl.emulated_precision import make_rollout_model
from predmask.rl.rollout import RolloutBatch, concat_batches, pad_rows
from predmask.rl.task import Problem, reward


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; otherwise the named device (must be available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; allowed here: cpu, auto")
    return dev


@torch.no_grad()
def generate_transformers(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    top_k: int,
    temperature: float = 1.0,
) -> RolloutBatch:
    """Sample with ``model.generate`` and report the top-K of mu per generated token (rewards left at zero).

    Sampling uses the global torch RNG (seed it first). mu = softmax(logits / temperature) with no other logits
    processor, so the reported log-probs are those of the distribution each token was drawn from.
    """
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=gen_cfg)
    p = prompt_ids.shape[1]
    response = out.sequences[:, p:]
    logits = torch.stack(list(out.logits), 1).float()  # [B, T, V] raw logits of each step
    logp = torch.log_softmax(logits / temperature, dim=-1)
    is_eos = (response == eos_id).long()
    mask = is_eos.cumsum(-1) - is_eos == 0  # up to and including the first eos of each row
    response = torch.where(mask, response, torch.full_like(response, pad_id))
    top = torch.topk(logp, top_k, dim=-1, sorted=True)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.bool(),
        response_ids=response,
        response_mask=mask,
        sampled_logprobs=logp.gather(-1, response.unsqueeze(-1)).squeeze(-1),
        topk_ids=top.indices,
        topk_logprobs=top.values,
        rewards=torch.zeros(response.shape[0], dtype=torch.float32, device=response.device),
    )


def batch_from_vllm(
    outputs: Sequence[Any], *, top_k: int, eos_id: int, pad_id: int, device: torch.device | str = "cpu"
) -> RolloutBatch:
    """A RolloutBatch from vLLM ``RequestOutput``s (rows: request i's completions in order; rewards zero).

    Each completion's ``logprobs[t]`` maps token id -> object with ``.logprob`` and ``.rank`` (1 = most likely);
    the entries of rank <= K are the top-K, the sampled token (``token_ids[t]``) is always present.
    """
    rows = []
    for req in outputs:
        prompt = torch.tensor([list(req.prompt_token_ids)], dtype=torch.long)
        for comp in req.outputs:
            tokens, sampled, ids, lps = list(comp.token_ids), [], [], []
            for tok, entries in zip(comp.token_ids, comp.logprobs):
                sampled.append(float(entries[tok].logprob))
                ranked = sorted(
                    (
                        (e.rank, int(i), float(e.logprob))
                        for i, e in entries.items()
                        if e.rank is not None and e.rank <= top_k
                    )
                )
                if len(ranked) < top_k:
                    raise ValueError(f"vLLM reported {len(ranked)} top log-probs, expected K={top_k}")
                ids.append([i for _, i, _ in ranked[:top_k]])
                lps.append([lp for _, _, lp in ranked[:top_k]])
            n = len(tokens)
            if not n:  # an empty completion: one padding position, so the batch is at least one token wide
                tokens, sampled, ids, lps = [pad_id], [0.0], [[pad_id] * top_k], [[float("-inf")] * top_k]
            rows.append(RolloutBatch(
                prompt,
                torch.ones_like(prompt, dtype=torch.bool),
                torch.tensor([tokens], dtype=torch.long),
                torch.arange(len(tokens))[None, :] < n,
                torch.tensor([sampled], dtype=torch.float32),
                torch.tensor([ids], dtype=torch.long),
                torch.tensor([lps], dtype=torch.float32),
                torch.zeros(1, dtype=torch.float32),
            ))
    return _to(concat_batches(rows, pad_id), device)


def _to(batch: RolloutBatch, device: torch.device | str) -> RolloutBatch:
    return RolloutBatch(**{k: v.to(device) for k, v in batch.__dict__.items()})


class HFBackend:
    """A Hugging Face checkpoint as the study's policy (``Backend``); the options are the study config's
    (``temperature``, ``device`` and the ``hf:`` block)."""

    def __init__(
        self,
        path: str | Path,
        *,
        precision: Precision,
        top_k: int,
        max_new_tokens: int,
        temperature: float,
        device: str,
        train_dtype: str,
        rollout_engine: str,
        prompt_template: str,
        rollout_chunk: int,
        vllm_kwargs: dict[str, Any],
        label: str = "",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"model checkpoint {self.path} does not exist")
        self.device = resolve_device(device)
        self.precision = precision
        self.top_k, self.max_new_tokens, self.temperature = top_k, max_new_tokens, temperature
        self.prompt_template = prompt_template
        self.rollout_chunk = rollout_chunk
        self.label = label or str(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[train_dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=dtype).to(self.device)
        self.vocab_size = int(self.model.config.vocab_size)
        self._base = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        eos = self.tokenizer.eos_token_id
        self.eos_id = int(eos if eos is not None else self.model.config.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)
        self.engine = self._pick_engine(rollout_engine)
        self._llm: Any = None
        self._vllm_kwargs = dict(vllm_kwargs)
        self._rollout_model: nn.Module | None = None

    @staticmethod
    def _pick_engine(name: str) -> str:
        if name not in ("auto", "vllm", "transformers"):
            raise ValueError(f"rollout_engine must be auto, vllm or transformers, got {name!r}")
        if name == "transformers":
            return name
        try:
            import vllm  # noqa: F401
        except ImportError:
            if name == "vllm":
                raise ValueError(
                    "rollout_engine=vllm but vllm is not installed (pip install predmask[vllm])"
                ) from None
            return "transformers"
        return "vllm"

    def policy(self) -> nn.Module:
        self.model.load_state_dict(self._base)
        return self.model

    def _rollout_copy(self) -> nn.Module:
        if self._rollout_model is None:
            self._rollout_model = make_rollout_model(self.policy(), self.precision)
        return self._rollout_model

    def rollout(self, problems: Sequence[Problem], n: int, seed: int) -> RolloutBatch:
        texts = [self.prompt_template.format(prompt=p.prompt) for p in problems]
        answers = [p.answer for p in problems for _ in range(n)]
        batch = (
            self._rollout_vllm(texts, n, seed) if self.engine == "vllm" else self._rollout_hf(texts, n, seed)
        )
        decoded = self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(batch.response_ids.cpu(), batch.response_mask.cpu())],
            skip_special_tokens=True,
        )
        batch.rewards = torch.tensor(
            [reward(t, a) for t, a in zip(decoded, answers)],
            dtype=torch.float32,
            device=batch.response_ids.device,
        )
        return batch

    def _rollout_hf(self, texts: list[str], n: int, seed: int) -> RolloutBatch:
        torch.manual_seed(seed)
        rows = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts for _ in range(n)]
        model = self._rollout_copy()
        parts = []
        for start in range(0, len(rows), self.rollout_chunk):
            ids, mask = pad_rows(rows[start : start + self.rollout_chunk], self.pad_id, left=True)
            parts.append(
                generate_transformers(
                    model,
                    ids.to(self.device),
                    mask.to(self.device),
                    max_new_tokens=self.max_new_tokens,
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    top_k=self.top_k,
                    temperature=self.temperature,
                )
            )
        if len(parts) == 1:
            return parts[0]
        return _to(concat_batches([_to(p, "cpu") for p in parts], self.pad_id), self.device)

    def _rollout_vllm(
        self, texts: list[str], n: int, seed: int
    ) -> RolloutBatch:  # pragma: no cover - needs GPU
        from vllm import LLM, SamplingParams

        if self._llm is None:
            kwargs = {
                "dtype": "bfloat16",
                "logprobs_mode": "processed_logprobs",
                "max_logprobs": self.top_k,
                "enable_prefix_caching": False,
                **self._vllm_kwargs,
            }
            if self.precision.rollout_fp8:
                kwargs.setdefault("quantization", "fp8")
            self._llm = LLM(model=str(self.path), **kwargs)
        params = SamplingParams(
            n=n,
            temperature=self.temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=self.max_new_tokens,
            logprobs=self.top_k,
            seed=seed,
        )
        outputs = self._llm.generate(texts, params, use_tqdm=False)
        return batch_from_vllm(
            outputs, top_k=self.top_k, eos_id=self.eos_id, pad_id=self.pad_id, device=self.device
        )

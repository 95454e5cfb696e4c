"""The device check: the whole loss of DPPO-TopK-KL and the predictive masks at Qwen3 scale on one GPU,
through ``scripts/benchmark.py loss`` (time ratio, peak memory against the logits, bf16 closed forms against
float64); then what skipping verl's old-log-prob forward saves on a small model (:func:`old_log_prob_share`).

    python scripts/device_check.py [--out DIR] [any option of scripts/benchmark.py loss, e.g. --device cpu --tokens 256 --vocab 4096]
    python scripts/device_check.py --cpu      # the CPU fallback: small sizes, a tiny model, under a minute or two

The old-log-prob saving: a randomly initialised Qwen3-0.6B-shaped causal LM (on CPU a tiny one; nothing
downloaded) over one batch: the time of verl's old-log-prob forward (no gradient) against the update's forward
+ backward of the same tokens, plain and with gradient checkpointing; ``share`` = forward / (forward + update)
is what a rollout-anchored method saves of the actor's compute, printed beside the dry-run's assumption.

Defaults: CUDA, bf16 logits, 8,192, 32,768 and 65,536 tokens, Qwen3's vocabulary, K = 20; output (bench.txt,
bench.json, old_log_prob.json) in ``--out``, else ``$OUT``, else ``results/device_check``. Needs torch (and
transformers for the saving) only. Exit status: 0 all loss targets met, 1 a target failed, 2 the machine
cannot run the check (the largest size does not fit the GPU: one line)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain copy of the repository, without installing it

import benchmark as entry  # scripts/benchmark.py, beside this file
import torch

from predmask import bench
from predmask.verl.trainer_hook import ASSUMED_OLD_LOG_PROB_SHARE

#: Qwen3's vocabulary (every Qwen3 model of the paper)
QWEN3_VOCAB = 151_936
#: response tokens of one loss call: 8k, 32k and 64k
TOKENS = (8_192, 32_768, 65_536)
#: GPU memory the check needs at most, in logits sizes: the logits themselves, the largest step (the plain
#: log_softmax reference: 4.0 x in bf16, measured on CPU), and 0.5 of margin (the float64 comparison works in chunks)
_FIT_FACTOR = 5.5


#: the CPU fallback's loss options (--cpu)
CPU_PRESET = ("--device", "cpu", "--tokens", "256", "--vocab", "4096", "--repeats", "2")
#: Qwen3-0.6B's shape (transformers' Qwen3Config keys), the model of the saving on a GPU
SMALL_QWEN3: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                               "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                               "vocab_size": QWEN3_VOCAB, "tie_word_embeddings": True}
#: the model of the saving on CPU
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "tie_word_embeddings": True}
#: (sequences, tokens each) of the saving's batch on a GPU and on CPU
OLP_BATCH = {"cuda": (8, 512), "cpu": (2, 64)}


def preset(argv: Sequence[str]) -> list[str]:
    """``argv`` with the device check's defaults for every option it does not give."""
    args = list(argv)
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    defaults = {"--device": "cuda", "--dtype": "bfloat16", "--tokens": ",".join(map(str, TOKENS)),
                "--vocab": str(QWEN3_VOCAB), "--out": os.environ.get("OUT") or str(ROOT / "results" / "device_check")}
    for option, value in defaults.items():
        if option not in given:
            args += [option, value]
    return args


def fits(args: Sequence[str]) -> str | None:
    """None when the largest size fits the chosen CUDA device, else one line saying why not."""
    ns = entry.parser().parse_args(["loss", *args])
    if not ns.device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"device_check: --device {ns.device} but no CUDA device is visible (torch {torch.__version__})"
    free, _ = torch.cuda.mem_get_info(torch.device(ns.device))
    need = max(ns.tokens) * ns.vocab * bench.DTYPES[ns.dtype].itemsize * _FIT_FACTOR
    if need > free:
        return (f"device_check: {max(ns.tokens)} tokens x {ns.vocab} need about {need / 2**30:.0f} GiB, the GPU has "
                f"{free / 2**30:.0f} GiB free; pass smaller --tokens")
    return None


def old_log_prob_share(device: str, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """What skipping the old-log-prob forward saves (module docstring), plain and with gradient checkpointing.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dev = torch.device(device)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    shape = SMALL_QWEN3 if kind == "cuda" else TINY
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, use_cache=False, attn_implementation="sdpa")).to(dev, dtype)
    sequences, length = OLP_BATCH[kind]
    ids = torch.randint(0, shape["vocab_size"], (sequences, length), device=dev)

    def token_logprobs() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), logp

    def forward() -> None:  # verl's compute_log_prob: no gradient, the tokens' log-probs and the entropy
        with torch.no_grad():
            _, logp = token_logprobs()
            (-(logp.exp() * logp).sum(-1)).mean().item()

    def update() -> None:  # the update's forward + backward on the same tokens
        model.zero_grad(set_to_none=True)
        lp, _ = token_logprobs()
        (-lp.mean()).backward()

    out: dict[str, Any] = {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), "model": shape,
                           "parameters": sum(p.numel() for p in model.parameters()), "sequences": sequences,
                           "tokens_each": length, "repeats": repeats,
                           "assumed_share": ASSUMED_OLD_LOG_PROB_SHARE}
    model.train()
    for mode in ("plain", "checkpointing"):
        if mode == "checkpointing":
            model.gradient_checkpointing_enable()
        fwd = bench.median_times({"forward": forward}, repeats, dev, warmup=1)["forward"]
        upd = bench.median_times({"update": update}, repeats, dev, warmup=1)["update"]
        out[mode] = {"forward_s": fwd, "update_s": upd, "share": fwd / (fwd + upd)}
    return out


def saving_lines(r: dict[str, Any]) -> list[str]:
    lines = [(f"old-log-prob forward vs update on a {r['parameters'] / 1e6:,.1f}M-parameter Qwen3-shaped model, "
              f"{r['sequences']} x {r['tokens_each']} tokens, {r['dtype']} on {r['device']} "
              f"(median of {r['repeats']})")]
    for mode in ("plain", "checkpointing"):
        m = r[mode]
        lines.append(f"  {mode:<14} forward {m['forward_s'] * 1e3:9.2f} ms   forward+backward "
                     f"{m['update_s'] * 1e3:9.2f} ms   share of the actor's compute {m['share']:.3f}")
    lines.append(f"  the dry-run assumes {r['assumed_share']:.3f} (predmask.verl.trainer_hook.ASSUMED_OLD_LOG_PROB_SHARE)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--cpu" in given:
        given = [*CPU_PRESET, *(a for a in given if a != "--cpu")]
    args = preset(given)
    problem = fits(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    start = time.perf_counter()
    ns = entry.parser().parse_args(["loss", *args])
    status = entry.main(["loss", *args])
    saving = old_log_prob_share(ns.device)
    print("\n".join(saving_lines(saving)))
    ns.out.mkdir(parents=True, exist_ok=True)
    entry.write_json(ns.out / "old_log_prob.json", saving)
    print(f"device_check: {time.perf_counter() - start:.0f} s, exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())

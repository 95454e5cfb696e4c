"""The device check: the whole loss of DPPO-TopK-KL and the predictive masks at Qwen3 scale on one GPU, through
``scripts/benchmark.py loss`` (time ratio, peak memory against the logits, bf16 closed forms against float64).

    python scripts/device_check.py [--out DIR] [any option of scripts/benchmark.py loss, e.g. --device cpu --tokens 256 --vocab 4096]

Defaults: CUDA, bf16 logits, 8,192, 32,768 and 65,536 tokens, Qwen3's vocabulary of 151,936, K = 20; the output
directory is ``--out``, else ``$OUT``, else ``results/device_check``. Needs torch only (no verl, vLLM, Ray or
network). Before measuring it checks that the largest size fits the GPU and says so in one line when it does not.
Exit status: 0 all targets met, 1 a target failed, 2 the machine cannot run the check.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain copy of the repository, without installing it

import benchmark as entry  # scripts/benchmark.py, beside this file
import torch

from predmask import bench

#: Qwen3's vocabulary (every Qwen3 model of the paper)
QWEN3_VOCAB = 151_936
#: response tokens of one loss call: 8k, 32k and 64k
TOKENS = (8_192, 32_768, 65_536)
#: GPU memory the check needs at most, in logits sizes: the logits themselves, the largest step (the plain
#: log_softmax reference: 4.0 x in bf16, measured on CPU), and 0.5 of margin (the float64 comparison works in chunks)
_FIT_FACTOR = 5.5


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


def main(argv: Sequence[str] | None = None) -> int:
    args = preset(sys.argv[1:] if argv is None else argv)
    problem = fits(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    start = time.perf_counter()
    status = entry.main(["loss", *args])
    print(f"device_check: {time.perf_counter() - start:.0f} s, exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Export a CPU stand-in base model as a Hugging Face model directory that verl and vLLM's CPU build load.

    python -m predmask.rl.hf_export model=cpu_s32 [key=value ...]

The directory holds the engine's cached base model (``predmask.rl.base.load_base_model``, built first when the cache
lacks it) as ``save_pretrained`` writes it (``config.json``, safetensors weights, ``generation_config.json`` with the
task's ``<bos>``/``<eos>``/``<pad>``), a tokenizer ``transformers.AutoTokenizer`` loads offline and
:data:`EXPORT_INFO` (what was exported, from which cache file). It lies beside the base model's cache file:
``<cache_dir>/base-<model>-<key>.hf`` (:func:`hf_export_dir`), written whole or not at all, and is reused while
the base model and this exporter are unchanged.

The tokenizer is the engine's (``predmask.rl.tokenizer.ArithmeticTokenizer``) in ``tokenizers`` form: the same
ids for every token (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the symbols, numbers ``0..max_number`` one token each),
the same split of text into tokens and the same decoded text. Its chat template gives the engine's prompt ids:
``apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True)`` is ``<bos>``
then the prompt's tokens, as the engine's rollout encodes it (``predmask.rl.rollout.encode_prompts``). Two tokens
follow the engine's vocabulary (:data:`VERL_QWEN_TOKENS`): verl 0.9.1's agent loop builds every Qwen3 model's
prompts with a builder that looks up ``<|im_end|>`` and a one-token newline; the model's vocabulary stays the
engine's, and no prompt of the task contains them.

vLLM's CPU attention serves only some head sizes (:data:`VLLM_CPU_HEAD_SIZES`); a model with another head_dim
(cpu_s: 16) is refused in one line naming the CPU models it serves (cpu_s32), unless ``--no-vllm-check``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from predmask.config import compose, cpu_models, group_entry, to_container
from predmask.console import error
from predmask.io import atomic_write_dir, atomic_write_text
from predmask.progress import waiting
from predmask.rl.base import DEFAULT_CACHE_DIR, base_cache_key, base_cache_path, load_base_model
from predmask.rl.engine import resolve_cpu_model
from predmask.rl.model import hf_config
from predmask.rl.tokenizer import DECODE_JOINS, PIECE_PATTERN, SPECIALS, ArithmeticTokenizer
from predmask.rundir import first_line, hold_lock, holder_stamp, storage_problem
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig

#: bump when what is written changes (tokenizer, template, files): an export of another version is written again
EXPORT_VERSION = 1
#: the export's own record in its directory: version, model, task, base config and the base model's info
EXPORT_INFO = "predmask_export.json"
#: the head sizes vLLM's CPU attention backend serves (vllm 0.24 ``CPUAttentionBackend.get_supported_head_sizes``)
VLLM_CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: tokens after the engine's vocabulary, looked up by verl 0.9.1's Qwen3 prompt builder (``<|im_end|>``, and
#: ``"\n"`` must be one token); special, so decoding skips them, and beyond the model's vocabulary
VERL_QWEN_TOKENS: tuple[str, ...] = ("<|im_end|>", "\n")
#: the prompt as the engine encodes it: ``<bos>``, the user turn's text (its tokens; spaces only separate them).
#: An assistant turn follows with ``<eos>`` (a worked solution, as the base model's pretraining saw it); the
#: generation prompt adds nothing, the response starts right after the problem's ``=``
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- ' ' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- ' ' + message['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('the arithmetic task has user and assistant turns only, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def head_dim(model_cfg: Mapping[str, Any], vocab_size: int) -> int:
    """The attention head size of a CPU model (its ``head_dim``, else hidden_size / num_attention_heads)."""
    cfg = hf_config(model_cfg, vocab_size)
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def vllm_cpu_problem(model_cfg: Mapping[str, Any], vocab_size: int) -> str | None:
    """Why vLLM's CPU build cannot serve this model (one line naming the CPU models it can), or None."""
    size = head_dim(model_cfg, vocab_size)
    if size in VLLM_CPU_HEAD_SIZES:
        return None
    served = [m for m in cpu_models() if head_dim(group_entry("model", m), vocab_size) in VLLM_CPU_HEAD_SIZES]
    return (f"model {model_cfg.get('name')!r} has head_dim {size}, which vLLM's CPU attention does not serve "
            f"(allowed: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); export model={' or model='.join(served) or '?'} "
            "for verl with vLLM on CPU, or pass --no-vllm-check for a Hugging Face-only export")


def hf_tokenizer(tok: ArithmeticTokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The engine's tokenizer as a ``transformers`` fast tokenizer (module docstring): same ids, same split, same
    decoded text; text with a piece outside the vocabulary raises, as the engine's ``encode`` does."""
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tok.tokens)}))
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")])
    # joined with spaces (WordPiece's decoder without "##" pieces), fused, then the engine's joins
    core.decoder = decoders.Sequence([decoders.WordPiece(prefix="##", cleanup=False), decoders.Fuse(),
                                      *(decoders.Replace(spaced, joined) for spaced, joined in DECODE_JOINS)])
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *VERL_QWEN_TOKENS)])
    pad, bos, eos = (tok.tokens[i] for i in (tok.pad_id, tok.bos_id, tok.eos_id))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                   model_max_length=model_max_length)


def hf_export_dir(model_cfg: Mapping[str, Any], task: TaskConfig, base_cfg: BaseConfig,
                  cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> Path:
    """Where a base model's export lives: beside its cache file, ``<cache_dir>/base-<model>-<key>.hf``."""
    return base_cache_path(model_cfg, task, base_cfg, cache_dir).with_suffix(".hf")


def _export_key(model_cfg: Mapping[str, Any], task: TaskConfig, base_cfg: BaseConfig) -> dict[str, Any]:
    """What makes an export current: this exporter's version, the model's name and its base model's cache key."""
    return {"export_version": EXPORT_VERSION, "model_name": model_cfg.get("name"),
            "base_key": base_cache_key(model_cfg, task, base_cfg)}


def _is_current(path: Path, key: Mapping[str, Any]) -> bool:
    try:
        found = json.loads((path / EXPORT_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and all(found.get(k) == v for k, v in key.items())


def _write(tmp: Path, model: nn.Module, tok: ArithmeticTokenizer, record: Mapping[str, Any]) -> None:
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                               pad_token_id=tok.pad_id)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one file of a few hundred kB: the command's own line says it is written
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    hf_tokenizer(tok, int(model.config.max_position_embeddings)).save_pretrained(tmp)
    config_file = tmp / "tokenizer_config.json"  # the class name transformers 4 and 5 both load
    tok_config = json.loads(config_file.read_text(encoding="utf-8"))
    atomic_write_text(config_file, json.dumps({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    atomic_write_text(tmp / EXPORT_INFO, json.dumps(record, indent=2, default=str) + "\n")


def export_base_model(
    model_cfg: Mapping[str, Any],
    task: TaskConfig,
    base_cfg: BaseConfig,
    *,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
    out: Path | None = None,
    vllm_check: bool = True,
    force: bool = False,
    progress: bool = True,
) -> tuple[Path, bool]:
    """Export the base model of ``model_cfg`` (a CPU model) to ``out`` (default :func:`hf_export_dir`); returns the
    directory and whether it was written now (False: a current export was there). ValueError in one line for a
    model vLLM's CPU build cannot serve (unless ``vllm_check`` is False)."""
    tok = ArithmeticTokenizer(task.max_number)
    if vllm_check and (problem := vllm_cpu_problem(model_cfg, tok.vocab_size)) is not None:
        raise ValueError(problem)
    path = Path(out) if out is not None else hf_export_dir(model_cfg, task, base_cfg, cache_dir)
    key = _export_key(model_cfg, task, base_cfg)
    phase = f"waiting for the export of {model_cfg.get('name')} (another process writes it)"
    with hold_lock(path.with_name(f"{path.name}.lock"), holder_stamp(), lambda _holder: waiting(phase)):
        if not force and _is_current(path, key):
            return path, False
        model, info = load_base_model(model_cfg, task, base_cfg, cache_dir=cache_dir, progress=progress)
        record = {**key, "stands_in_for": model_cfg.get("stands_in_for"), "label": model_cfg.get("label"),
                  "model": dict(model_cfg), "task": task.to_dict(), "base": asdict(base_cfg),
                  "base_info": {k: v for k, v in info.items() if k != "built"},
                  "vocab": {"engine": tok.vocab_size, "tokenizer_extra": list(VERL_QWEN_TOKENS)}}
        atomic_write_dir(path, lambda tmp: _write(tmp, model, tok, record))
    return path, True


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m predmask.rl.hf_export", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides (key=value, composed on conf/train.yaml): model=cpu_s32 (the CPU model, or a paper model "
               "for its stand-in), task.*, base.*, cache_dir=DIR\n"
               "default directory: <cache_dir>/base-<model>-<key>.hf, beside the base model's cache file")
    p.add_argument("--out", type=Path, help="write here instead of beside the base model's cache file")
    p.add_argument("--force", action="store_true", help="write again even if a current export is there")
    p.add_argument("--no-vllm-check", action="store_true",
                   help="export a model whose head_dim vLLM's CPU attention does not serve (Hugging Face use only)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m predmask.rl.hf_export``: the export's directory on stdout, or one ``error:`` line (exit 2, or 1
    for a full disk or read-only file system, 130 on Ctrl-C)."""
    args = _parser().parse_args(argv)
    where = Path(args.out or DEFAULT_CACHE_DIR)
    try:
        c = to_container(compose("train", args.overrides))
        where = Path(args.out or str(c["cache_dir"]))
        model_cfg = resolve_cpu_model(c["model"])
        task, base_cfg = TaskConfig.from_mapping(c["task"]), BaseConfig.from_mapping(c["base"])
        path, written = export_base_model(model_cfg, task, base_cfg, cache_dir=str(c["cache_dir"]), out=args.out,
                                          vllm_check=not args.no_vllm_check, force=args.force)
    except ValueError as exc:
        error(first_line(exc))
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing exported (a partial export is never left behind)", file=sys.stderr)
        return 130
    except OSError as exc:
        error(storage_problem(exc, where) or first_line(exc))
        return 1
    what = f"{model_cfg['name']} (CPU stand-in for {model_cfg.get('stands_in_for')}, not the real model)"
    print(f"{'exported' if written else 'already exported'} {what}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

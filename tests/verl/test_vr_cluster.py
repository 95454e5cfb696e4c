"""The variational family on a cluster: stage commands composed against verl 0.9.1's real SFT config, the weighted
SFT loss against verl's own ``sft_loss``, the final stage's data, and ``vr_sample`` through a stub vLLM.

Truth: verl's ``sft_trainer_engine`` config composed with Hydra's compose API and turned into verl's own config
dataclasses (as ``verl.trainer.sft_trainer_ray`` does); verl's ``sft_loss`` on the same jagged tensors (with all
weights 1 ours must equal it times batch_num_tokens / normaliser); sums written out per sample in the test.
vLLM cannot be installed here: ``vr_sample`` runs in real subprocesses against a stub ``vllm`` package written to
a temporary directory (a fixed bigram table over a character tokenizer; the test recomputes every log-prob from
the table itself). Nothing runs on a GPU; what stays unverified is listed in docs/cluster.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from verl_helpers import REPO, require_verl, run_without

from predmask import metrics as M
from predmask.config import compose as compose_config
from predmask.config import to_container
from predmask.verl.vr_cluster import CLUSTER_RECIPES, VR_DATA_FILES, stage_command
from predmask.vr_stages import stage_inputs

pytestmark = pytest.mark.verl

RUN_DIR = "/shared/runs/variational_reasoning/r-final"
INPUTS = {"prior": "r-prior", "posterior": "r-post", "traces": "r-traces", "weights": "r-weights",
          "rft_samples": "r-rft", "final": "r-final"}
#: the composed stage config on the paper's cluster (its cluster.variational: conf/cluster/h20_4x8.yaml)
BASE = to_container(compose_config("variational", [
    "cluster=h20_4x8", "model=qwen3_4b_base", "model.path=/models/Qwen3-4B-Base", "cluster.nodes=4",
    "cluster.gpus_per_node=8", "cluster.data_dir=/data/predmask"]))
SETTINGS = BASE["cluster"]["variational"]


def cfg(stage: str, method: dict | None = None, **cluster) -> dict:
    """A stage config: BASE with the stage, its method and inputs, and ``cluster`` merged into its cluster section."""
    reads = stage_inputs(stage, (method or {"name": stage})["name"], cluster=True)
    return {
        **BASE, "stage": stage, "seed": 2, "method": method or {"name": stage}, "inputs": {k: INPUTS[k] for k in reads},
        "cluster": OmegaConf.to_container(OmegaConf.merge(BASE["cluster"], cluster)),
        "sweep": "variational_reasoning", "run_id": "r-final",
    }


CASES = [("prior", None), ("posterior", None), ("final", {"name": "sft"}), ("final", {"name": "rft"})] + [
    ("final", {"name": r, "estimator": r[3:], "data": d}) for r in CLUSTER_RECIPES if r.startswith("vr_")
    for d in ("all_weighted", "best_mixed")
]


@pytest.fixture(scope="module")
def compose():
    """verl's sft_trainer_engine composed with the command's verl overrides (predmask.* and hydra.* taken off)."""
    require_verl()
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from predmask.verl.vr_sft import split_predmask_args

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        def run(argv: list[str]):
            verl_argv, keys = split_predmask_args(argv[3:])
            c = hydra_compose(config_name="sft_trainer_engine",
                              overrides=[o for o in verl_argv if not o.startswith("hydra.")])
            OmegaConf.resolve(c)
            return c, keys

        yield run


@pytest.mark.parametrize(("stage", "method"), CASES)
def test_sft_stage_commands_compose_with_verl_sft_config(compose, stage: str, method: dict | None) -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_extern_object

    argv = stage_command(cfg(stage, method), RUN_DIR, "python3")
    assert argv[:3] == ["python3", "-m", "predmask.verl.vr_sft"]
    c, keys = compose(argv)
    engine = omega_conf_to_dataclass(c.engine)
    optim = omega_conf_to_dataclass(c.optim)
    ckpt = omega_conf_to_dataclass(c.checkpoint)
    settings = SETTINGS[stage]
    assert type(engine).__name__ == "FSDPEngineConfig" and engine.ulysses_sequence_parallel_size == 2
    assert optim.lr == settings["lr"] and c.data.train_batch_size == settings["batch"]
    assert c.trainer.total_epochs == settings["epochs"] and (c.trainer.nnodes, c.trainer.n_gpus_per_node) == (4, 8)
    assert "hf_model" in ckpt.save_contents and c.trainer.default_local_dir == f"{RUN_DIR}/checkpoints"
    assert c.data.pad_mode == "no_padding" and c.model.path == "/models/Qwen3-4B-Base"
    # the cluster's attention, where verl's model config reads it (its default, flash_attention_2, spelled out)
    assert c.model.override_config.attn_implementation == "flash_attention_2" == BASE["cluster"]["attn_implementation"]
    assert keys["normaliser"] == SETTINGS["normaliser_tokens"] * settings["batch"] and keys["stage"] == stage
    # the custom dataset verl will load is ours, found through verl's own loader
    cls = load_extern_object(c.data.custom_cls.path, c.data.custom_cls.name)
    assert cls.__name__ == "WeightedSFTDataset" and cls.__mro__[1].__name__ == "MultiTurnSFTDataset"
    train = list(c.data.train_files)
    if stage == "prior" or (method and method["name"] == "sft"):
        assert train == [f"/data/predmask/{VR_DATA_FILES['sft']}"] and "recipe" not in keys
    elif stage == "posterior":
        assert train == [f"/data/predmask/{VR_DATA_FILES['posterior']}"]
    elif method["name"] == "rft":
        assert train == [keys["train_file"]] == [f"{RUN_DIR}/final_sft.parquet"] and keys["recipe"] == "rft"
        assert keys["samples_file"] == "/shared/runs/variational_reasoning/r-rft/rft_samples.parquet"
    else:
        assert train == [keys["train_file"]] == [f"{RUN_DIR}/final_sft.parquet"]
        assert keys["weights_file"] == "/shared/runs/variational_reasoning/r-weights/weights.parquet"
        assert keys["traces_file"] == "/shared/runs/variational_reasoning/r-traces/traces.parquet"
        assert (keys["estimator"], keys["data"]) == (method["estimator"], method["data"])


def test_sampling_stage_commands() -> None:
    traces = stage_command(cfg("traces"), "/r/t", "python3")
    assert traces[:4] == ["python3", "-m", "predmask.verl.vr_sample", "traces"]
    args = dict(zip(traces[4::2], traces[5::2], strict=True))
    assert args["--posterior"] == "/r/r-post/checkpoints" and args["--k"] == "8" and args["--replicas"] == "8"
    weights = stage_command(cfg("weights"), "/r/w", "python3")
    args = dict(zip(weights[4::2], weights[5::2], strict=True))
    assert args["--prior"] == "/r/r-prior/checkpoints" and args["--traces"] == "/r/r-traces/traces.parquet"
    assert args["--m"] == "8" and args["--questions"] == f"/data/predmask/{VR_DATA_FILES['questions']}"
    rft = stage_command(cfg("rft_samples"), "/r/s", "python3")
    assert rft[:4] == ["python3", "-m", "predmask.verl.vr_sample", "rft"]
    args = dict(zip(rft[4::2], rft[5::2], strict=True))
    assert args["--prior"] == "/r/r-prior/checkpoints" and args["--samples"] == str(SETTINGS["rft"]["samples"])
    for method, model in (({"name": "prior"}, "/r/r-prior/checkpoints"), ({"name": "rft"}, "/r/r-final/checkpoints"),
                          ({"name": "vr_gml", "estimator": "gml", "data": "best_mixed"}, "/r/r-final/checkpoints")):
        ev = stage_command(cfg("eval", method), "/r/e", "python3")
        assert ev[:4] == ["python3", "-m", "predmask.verl.vr_sample", "eval"]
        files = [ev[i + 1] for i, a in enumerate(ev) if a == "--eval-file"]
        assert files == ["/data/predmask/aime24.parquet", "/data/predmask/aime25.parquet"]
        assert ev[ev.index("--model") + 1] == model and ev[ev.index("--n") + 1] == str(SETTINGS["eval"]["n"])
        assert ev[ev.index("--temperature") + 1] == repr(SETTINGS["eval"]["temperature"])


@pytest.mark.parametrize(("config", "message"), [
    (cfg("final", {"name": "sft"}) | {"stage": "dpo"},
     "unknown stage 'dpo'; allowed: prior, posterior, traces, weights, rft_samples, final, eval"),
    ({**cfg("final", {"name": "rft"}), "inputs": {}}, "stage final needs inputs.rft_samples"),
    ({**cfg("eval", {"name": "sft"}), "inputs": {}}, "stage eval needs inputs.final"),
    (cfg("final", {"name": "vr_acc", "data": "some"}), "unknown method.data='some'; allowed: all_weighted, best_mixed"),
    (cfg("final", {"name": "vr_acc", "estimator": "gml"}), "does not match recipe vr_acc"),
    ({**cfg("traces"), "inputs": {}}, "stage traces needs inputs.posterior"),
    (cfg("prior", variational={"prior": {"batch": 100}}), "batch 100 must be a multiple of the data-parallel size 16"),
    (cfg("prior", variational={"k": 8}), "unknown cluster.variational key 'k'"),
    # verl 0.9.1's Ulysses all-to-all lives in its flash-attention forward: sdpa would attend within each rank's slice
    (cfg("prior", attn_implementation="sdpa"), ("cluster.attn_implementation=sdpa with "
     "cluster.variational.sequence_parallel=2: verl 0.9.1 runs Ulysses sequence parallelism inside flash_attention_2")),
    (cfg("weights", variational={"weights": {"m": 0}}), "cluster.variational.weights.m must be a positive int"),
    # settings of the CPU engine's variational stages that the cluster's data files fix: refused, not ignored
    (cfg("traces") | {"hint": {**BASE["hint"], "use": False}},
     "hint.use=False runs on the CPU engine only; the cluster path runs hint.use=True"),
    (cfg("posterior") | {"posterior": {**BASE["posterior"], "source": "prior"}},
     "posterior.source='prior' runs on the CPU engine only; the cluster path runs posterior.source='original'"),
])
def test_bad_input_is_one_line(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        stage_command(config, "/r/x", "python3")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_stage_command_and_data_preparation_need_no_verl(tmp_path: Path) -> None:
    fixture = REPO / "tests" / "fixtures" / "bespoke_stratos" / "bespoke_stratos_tiny.jsonl"
    proc = run_without(f"""
        from pathlib import Path
        from sweeps.datasets import prepare_variational
        assert prepare_variational(Path({str(tmp_path)!r}), bespoke_file=Path({str(fixture)!r}))["rows"] == 4
        from predmask.config import compose, to_container
        from predmask.verl.vr_cluster import stage_command
        c = to_container(compose("variational", ["cluster=h20_4x8", "model=qwen3_4b_base", "model.path=/m",
                                                 "cluster.nodes=1", "cluster.data_dir=/d", "stage=final",
                                                 "vr_method@method=vr_gml", "method.data=best_mixed"]))
        c["inputs"] = {{"traces": "t", "weights": "w"}}
        print(stage_command(c, "/runs/s/f", "python3")[2])
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "predmask.verl.vr_sft", proc.stderr[-2000:]


# -- the loss -----------------------------------------------------------------------------------------------------

def _batch(lengths: list[int], weights: list[float], dp_size: int, seed: int = 0):
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(seed)
    logps = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lengths]
    masks = [torch.tensor([0] * (n // 2) + [1] * (n - n // 2)) for n in lengths]  # prompt then response tokens
    data = tu.get_tensordict(
        tensor_dict={"loss_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged),
                     "loss_weight": torch.nested.as_nested_tensor(
                         [torch.full((n,), w, dtype=torch.float32) for n, w in zip(lengths, weights, strict=True)],
                         layout=torch.jagged)},
        non_tensor_dict={"pad_mode": DatasetPadMode.NO_PADDING, "dp_size": dp_size,
                         "batch_num_tokens": int(sum(int(m.sum()) for m in masks))})
    out = {"log_probs": torch.nested.as_nested_tensor(logps, layout=torch.jagged)}
    return out, data, logps, masks


def test_weighted_loss_equals_a_direct_sum_and_verls_sft_loss() -> None:
    require_verl("verl.workers.utils.losses")
    from verl.workers.utils.losses import sft_loss

    from predmask.verl.vr_sft import nested_weighted_sft_loss

    lengths, weights, dp, c = [5, 8, 3], [0.25, 1.5, 0.0], 2, 1000.0
    out, data, logps, masks = _batch(lengths, weights, dp)
    ours = nested_weighted_sft_loss(None, out, data, normaliser=c)[0]
    # direct: log_prob[t] scores token t+1, so token t+1's mask and weight apply (verl's left shift within a sample)
    direct = -sum(w * float((lp[:-1] * m[1:]).sum()) for lp, m, w in zip(logps, masks, weights, strict=True)) / c * dp
    assert float(ours) == pytest.approx(direct, rel=1e-12)
    ones = _batch(lengths, [1.0] * 3, dp)
    verl_loss = sft_loss(None, ones[0], ones[1])[0]
    ours_one = nested_weighted_sft_loss(None, ones[0], ones[1], normaliser=c)[0]
    # verl's own loss divides by the batch's token count; ours by the constant: the same tokens otherwise
    # (verl's shift wraps the last mask to the first token of the flattened stream; here that token is a prompt token)
    assert float(ours_one) == pytest.approx(float(verl_loss) * ones[1]["batch_num_tokens"] / c, rel=1e-12)


def test_weighted_dataset_adds_the_row_weight(tmp_path: Path) -> None:
    require_verl("verl.utils.dataset.multiturn_sft_dataset")
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from predmask.verl import vr_sft

    words = ["<pad>", "<unk>", "<user>", "<assistant>", "<eos>", "1+1?", "2+2?", "2", "4"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
                         "{% if m['role'] == 'assistant' %}<eos> {% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant> {% endif %}")
    rows = [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], "weight": 0.3},
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "weight": 2.0}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = vr_sft.WeightedSFTDataset(str(path), tok, OmegaConf.create(
        {"pad_mode": "no_padding", "max_length": 64, "ignore_input_ids_mismatch": True}))
    for i, w in enumerate((0.3, 2.0)):
        item = ds[i]
        assert item["loss_weight"].shape == item["loss_mask"].shape
        assert torch.all(item["loss_weight"] == torch.tensor(w, dtype=torch.float32))


# -- the final stage's data -----------------------------------------------------------------------------------------

QUESTIONS = [{"question": q, "system": "S", "prompt": f"P{q}", "response": f"R{q}", "answer_text": f"|A{q}"}
             for q in range(3)]
TRACES = [{"question": q, "trace": k, "trace_text": f"z{q}.{k}"} for q in range(3) for k in range(2)]
WEIGHTS = [{"question": 0, "trace": 0, "weight_acc": 0.25}, {"question": 0, "trace": 1, "weight_acc": 0.75},
           {"question": 1, "trace": 0, "weight_acc": 1.0}, {"question": 1, "trace": 1, "weight_acc": 0.0},
           {"question": 2, "trace": 0, "weight_acc": 0.0}, {"question": 2, "trace": 1, "weight_acc": 0.0}]


def test_final_rows_all_weighted_and_best_mixed() -> None:
    from predmask.verl.vr_sft import final_rows

    rows = final_rows(QUESTIONS, TRACES, WEIGHTS, estimator="acc", data="all_weighted")
    assert [(r["question"], r["trace"], r["weight"]) for r in rows] == [(0, 0, 0.25), (0, 1, 0.75), (1, 0, 1.0)]
    assert rows[1]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "P0"},
                                   {"role": "assistant", "content": "z0.1|A0"}]
    best = final_rows(QUESTIONS, TRACES, WEIGHTS, estimator="acc", data="best_mixed")
    assert [(r["question"], r["trace"], r["weight"]) for r in best] == [
        (0, 1, 1.0), (1, 0, 1.0), (0, -1, 1.0), (1, -1, 1.0), (2, -1, 1.0)]
    assert best[2]["messages"][-1]["content"] == "R0"


def test_vr_sft_missing_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run" / "final_sft.parquet"
    argv = ["predmask.normaliser=10.0", "predmask.recipe=vr_acc", "predmask.estimator=acc", "predmask.data=all_weighted",
            f"predmask.weights_file={tmp_path / 'nope' / 'weights.parquet'}", f"predmask.traces_file={tmp_path}/t.parquet",
            f"predmask.questions_file={tmp_path}/q.parquet", f"predmask.train_file={out}", "predmask.stage=final"]
    proc = subprocess.run([sys.executable, "-m", "predmask.verl.vr_sft", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"predmask.verl.vr_sft: stage final: missing {tmp_path / 'nope' / 'weights.parquet'}; run the weights stage first"]
    assert not out.parent.exists()
    bad = subprocess.run([sys.executable, "-m", "predmask.verl.vr_sft", "predmask.normalizer=3"], capture_output=True,
                         text=True, cwd=REPO, timeout=120, check=False)
    assert bad.returncode == 2 and "unknown key predmask.normalizer" in bad.stderr


def test_a_restarted_vr_sft_keeps_the_previous_attempts_metrics(tmp_path: Path, monkeypatch) -> None:
    """verl's file logger opens its file with "wb": each attempt of a stage moves the previous one's lines aside
    (predmask.rundir's attempt files, which ingest merges), under the run directory's lock."""
    require_verl("verl.trainer.sft_trainer_ray")
    from verl.trainer import sft_trainer_ray
    from verl.workers.utils import losses

    from predmask.rundir import attempt_files, metrics_line, read_metrics
    from predmask.verl import vr_sft

    run_dir = tmp_path / "run"
    attempts: list[int] = []

    def verl_sft() -> None:  # what verl's trainer does to the file logger's file: truncate, then write
        attempts.append(len(attempts) + 1)
        Path(os.environ["VERL_FILE_LOGGER_PATH"]).write_text(metrics_line(1, {"attempt": attempts[-1]}))

    monkeypatch.setattr(sft_trainer_ray, "main", verl_sft)
    monkeypatch.setattr(losses, "sft_loss", losses.sft_loss)
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    for _ in range(3):
        assert vr_sft.main(["predmask.normaliser=1.0", f"predmask.run_dir={run_dir}"]) == 0
    files = attempt_files(run_dir)
    assert [f.name for f in files] == ["metrics.attempt-1.jsonl", "metrics.attempt-2.jsonl", "metrics.jsonl"]
    assert [read_metrics(f)[0]["data"]["attempt"] for f in files] == [1, 2, 3]


# -- vr_sample through a stub vLLM --------------------------------------------------------------------------------

VOCAB = 128
EOS = 0
#: the stub ``vllm`` package (written to a temp dir, first on PYTHONPATH of the subprocesses). Its model is a fixed
#: bigram table (``STUB_VLLM_TABLE``, a torch file [V, V] of logits); tokens are characters (id = code point, < 128);
#: the chat template is "<s>SYSTEM<u>USER<a>". Generation is canned, the k-th completion of a prompt ends in
#: \\boxed{k}: traces get a thought section, answers (prompts ending in the end-of-thought marker) only a solution.
#: Every LLM() call appends its model path, tensor_parallel_size and CUDA_VISIBLE_DEVICES to STUB_VLLM_LOG.
STUB = r'''
import json, os
from types import SimpleNamespace
import torch

__version__ = "0.0-stub"
_TABLE = torch.log_softmax(torch.load(os.environ["STUB_VLLM_TABLE"]).double(), dim=-1)


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None, prompt_logprobs=None, **kw):
        self.n, self.max_tokens, self.prompt_logprobs = n, max_tokens, prompt_logprobs


class _Tok:
    eos_token_id = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        tags = {"system": "<s>", "user": "<u>", "assistant": "<a>"}
        text = "".join(tags[m["role"]] + m["content"] for m in messages)
        return text + ("<a>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [min(ord(c), 127) for c in text]}


class LLM:
    def __init__(self, model, tensor_parallel_size=1, seed=0, gpu_memory_utilization=0.9, max_model_len=None,
                 max_num_batched_tokens=None, enable_chunked_prefill=None):
        with open(os.environ["STUB_VLLM_LOG"], "a") as fh:
            fh.write(json.dumps({"model": model, "tp": tensor_parallel_size,
                                 "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                 "max_num_batched_tokens": max_num_batched_tokens,
                                 "chunked": enable_chunked_prefill}) + "\n")

    def get_tokenizer(self):
        return _Tok()

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            if params.prompt_logprobs is not None:
                lp = [None] + [{ids[i]: SimpleNamespace(logprob=float(_TABLE[ids[i - 1], ids[i]]))}
                               for i in range(1, len(ids))]
                outs.append(SimpleNamespace(prompt_logprobs=lp, outputs=[SimpleNamespace(text="")]))
                continue
            text = "".join(map(chr, ids))
            if text.endswith("<|end_of_thought|>"):
                made = [f"\n\n<|begin_of_solution|>\n\n\\boxed{{{k}}}\n\n<|end_of_solution|>"
                        for k in range(params.n)]
            else:
                made = [f"<|begin_of_thought|>\n\nstep {k} of {len(ids) % 7}\n\n<|end_of_thought|>"
                        f"\n\n<|begin_of_solution|>\n\n\\boxed{{{k}}}\n\n<|end_of_solution|>"
                        for k in range(params.n)]
            outs.append(SimpleNamespace(prompt_logprobs=None, outputs=[
                SimpleNamespace(text=t, token_ids=[min(ord(c), 127) for c in t]) for t in made]))
        return outs
'''


@pytest.fixture(scope="module")
def stub_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("stubvllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(STUB))
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    torch.save(table, root / "table.pt")
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(root), str(REPO), env.get("PYTHONPATH", "")]),
                "STUB_VLLM_TABLE": str(root / "table.pt"), "STUB_VLLM_LOG": str(root / "llm.jsonl")})
    return {"env": env, "table": torch.log_softmax(table.double(), dim=-1), "log": root / "llm.jsonl"}


def _hf_export(checkpoints: Path, steps: tuple[int, ...], latest: int) -> Path:
    for n in steps:
        hf = checkpoints / f"global_step_{n}" / "huggingface"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(latest))
    return checkpoints / f"global_step_{latest}" / "huggingface"


def _logp(table: torch.Tensor, text_ids: list[int], start: int, end: int) -> float:
    return sum(float(table[text_ids[i - 1], text_ids[i]]) for i in range(start, end))


def _ids(text: str) -> list[int]:
    return [min(ord(c), 127) for c in text]


def _sample(stub_env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "predmask.verl.vr_sample", *args], capture_output=True, text=True,
                          cwd=REPO, env=stub_env["env"], timeout=300, check=False)


def test_traces_and_weights_through_a_stub_vllm(tmp_path: Path, stub_env: dict) -> None:
    from sweeps.datasets import prepare_variational

    data = tmp_path / "data"
    prepare_variational(data, bespoke_file=REPO / "tests" / "fixtures" / "bespoke_stratos" / "bespoke_stratos_tiny.jsonl")
    questions = pq.read_table(data / VR_DATA_FILES["questions"]).to_pylist()
    sweep = tmp_path / "sweep"
    post_hf = _hf_export(sweep / "r-post" / "checkpoints", (1, 3), 3)
    prior_hf = _hf_export(sweep / "r-prior" / "checkpoints", (2,), 2)
    k, m = 3, 8
    argv = stage_command(cfg("traces", nodes=1, gpus_per_node=4, variational={
        "data_dir": str(data), "vllm": {"tensor_parallel": 2}, "traces": {"k": k}, "weights": {"m": m}}),
        sweep / "r-traces", sys.executable)
    proc = _sample(stub_env, *argv[3:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = pq.read_table(sweep / "r-traces" / "traces.parquet").to_pylist()
    assert [(t["question"], t["trace"]) for t in traces] == [(q, j) for q in range(4) for j in range(k)]
    calls = [json.loads(line) for line in stub_env["log"].read_text().splitlines()]
    assert sorted(c["gpus"] for c in calls) == ["0,1", "2,3"] and {c["model"] for c in calls} == {str(post_hf)}
    bound = int(argv[argv.index("--max-num-batched-tokens") + 1])
    assert {(c["max_num_batched_tokens"], c["chunked"]) for c in calls} == {(bound, True)}  # the memory bound
    table = stub_env["table"]
    for t in traces:
        q = questions[t["question"]]
        hint = f"<s>{q['system']}<u>{q['hint_prompt']}<a>"
        assert t["trace_text"].startswith("<|begin_of_thought|>") and t["trace_text"].endswith("<|end_of_thought|>")
        assert t["answer_text"].strip().endswith(f"\\boxed{{{t['trace']}}}\n\n<|end_of_solution|>")
        seq = _ids(hint + t["trace_text"])
        assert t["trace_tokens"] == len(t["trace_text"])
        assert t["log_posterior"] == pytest.approx(_logp(table, seq, len(hint), len(seq)), rel=1e-9)
        assert t["posterior_correct"] == (q["reference_answer"] == str(t["trace"]))
    assert t["prompt"] == f"<s>{q['system']}<u>{q['prompt']}<a>"

    stub_env["log"].unlink()
    argv = stage_command(cfg("weights", nodes=1, gpus_per_node=4, variational={
        "data_dir": str(data), "vllm": {"tensor_parallel": 4}, "weights": {"m": m}}), sweep / "r-weights", sys.executable)
    proc = _sample(stub_env, *argv[3:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["model"] for line in stub_env["log"].read_text().splitlines()] == [str(prior_hf)]
    weights = pq.read_table(sweep / "r-weights" / "weights.parquet").to_pylist()
    assert list(weights[0]) == ["question", "trace", "trace_tokens", "answer_tokens", "log_prior", "log_posterior",
                                "log_ratio", "answer_logp", "acc", "posterior_correct", "weight_acc", "weight_gml",
                                "weight_likelihood"]
    expect: dict[str, list[float]] = {"acc": [], "gml": [], "likelihood": []}
    for w, t in zip(weights, traces, strict=True):
        q = questions[w["question"]]
        x = _ids(f"<s>{q['system']}<u>{q['prompt']}<a>")
        seq = x + _ids(t["trace_text"]) + _ids(q["answer_text"]) + [EOS]
        a, b = len(x), len(x) + len(t["trace_text"])
        assert w["log_prior"] == pytest.approx(_logp(table, seq, a, b), rel=1e-9)
        assert w["answer_logp"] == pytest.approx(_logp(table, seq, b, len(seq)), rel=1e-9)
        assert w["answer_tokens"] == len(q["answer_text"]) + 1 and w["log_posterior"] == t["log_posterior"]
        ratio = (w["log_prior"] - w["log_posterior"]) / w["trace_tokens"]
        assert w["log_ratio"] == pytest.approx(ratio, rel=1e-9)
        # the stub's j-th answer is \boxed{j}: one of M=8 is right when the reference is a digit below 8
        acc = (1 / m) if q["reference_answer"] in [str(j) for j in range(m)] else 0.0
        assert w["acc"] == acc
        expect["acc"].append(math.log(acc) + ratio if acc else -math.inf)
        expect["gml"].append(w["answer_logp"] / w["answer_tokens"] + ratio)
        expect["likelihood"].append(w["answer_logp"] + ratio)
    for name, logs in expect.items():
        for qid in range(4):
            mine = [lw for lw, w in zip(logs, weights, strict=True) if w["question"] == qid]
            top = max(mine)
            norm = [0.0] * len(mine) if top == -math.inf else [math.exp(v - top) / sum(math.exp(u - top) for u in mine)
                                                               for v in mine]
            got = [w[f"weight_{name}"] for w in weights if w["question"] == qid]
            assert got == pytest.approx(norm, rel=1e-9, abs=1e-12), (name, qid)
    assert sum(w["weight_acc"] for w in weights) == pytest.approx(1.0)  # only question 3 (x = 5) is checkable right
    assert not (sweep / "r-weights" / ".vr_sample_parts").exists()


def test_vr_sample_missing_upstream_exits_2_and_writes_nothing(tmp_path: Path, stub_env: dict) -> None:
    data = tmp_path / "data"
    from sweeps.datasets import prepare_variational

    prepare_variational(data, bespoke_file=REPO / "tests" / "fixtures" / "bespoke_stratos" / "bespoke_stratos_tiny.jsonl")
    (tmp_path / "r-post" / "checkpoints").mkdir(parents=True)
    argv = stage_command(cfg("traces", nodes=1, gpus_per_node=1, variational={"data_dir": str(data)}),
                         tmp_path / "r-traces", sys.executable)
    proc = _sample(stub_env, *argv[3:])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [(
        f"predmask.verl.vr_sample: stage traces: missing the posterior model under {tmp_path}/r-post/checkpoints "
        "(no config.json, no global_step_<n>/huggingface export); run the posterior stage first")]
    assert not (tmp_path / "r-traces").exists()
    _hf_export(tmp_path / "r-prior" / "checkpoints", (1,), 1)
    argv = stage_command(cfg("weights", nodes=1, gpus_per_node=1, variational={"data_dir": str(data)}),
                         tmp_path / "r-weights", sys.executable)
    proc = _sample(stub_env, *argv[3:])
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"predmask.verl.vr_sample: stage weights: missing {tmp_path}/r-traces/traces.parquet; run the traces stage first")
    assert not (tmp_path / "r-weights").exists()
    bad = _sample(stub_env, "weights", "--run-dir", str(tmp_path / "x"), "--questions", str(data / "q"), "--m", "0",
                  "--prior", "p", "--traces", "t")
    assert bad.returncode == 2 and "answers per trace M = 0 is not allowed" in bad.stderr


# -- the rft final and the evaluation ---------------------------------------------------------------------------

def test_eval_metrics_by_hand() -> None:
    from predmask.verl.vr_sample import eval_metrics

    # problem 1: 2 of 4 right; problem 2: none. pass@k per problem: 1 - C(4-c, k)/C(4, k)
    # problem 1: k=1: 1/2, k=2: 1 - 1/6 = 5/6, k=3: 1, k=4: 1; problem 2: 0 -> the means below
    got = eval_metrics("aime24", [[True, False, False, True], [False] * 4], [[10, 20, 30, 40], [1, 2, 3, 4]])
    assert got[M.val_acc("aime24", 4)] == 0.25
    expect = {1: 0.25, 2: 5 / 12, 3: 0.5, 4: 0.5}
    assert {k: got[M.val_pass("aime24", k)] for k in range(1, 5)} == pytest.approx(expect, rel=1e-12)
    assert got[M.val_response_length("aime24")] == 13.75  # (100 + 10) / 8
    assert len(got) == 6


def test_rft_rows_keep_the_correct_samples_weighted_one_over_samples() -> None:
    from predmask.verl.vr_sft import rft_rows

    questions = [{"question": 0, "system": "S", "prompt": "P0"}, {"question": 1, "system": "", "prompt": "P1"}]
    samples = [{"question": 0, "trace": j, "response": f"r{j}", "correct": j in (1, 2)} for j in range(4)]
    samples += [{"question": 1, "trace": j, "response": f"s{j}", "correct": j == 0} for j in range(2)]
    rows = rft_rows(questions, samples)
    assert [(r["question"], r["trace"], r["weight"]) for r in rows] == [(0, 1, 0.25), (0, 2, 0.25), (1, 0, 0.5)]
    assert rows[0]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "P0"},
                                   {"role": "assistant", "content": "r1"}]
    assert rows[2]["messages"][0] == {"role": "user", "content": "P1"}


def _eval_file(path: Path, source: str, references: list[str]) -> Path:
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"wrapped {i}"}],
             "reward_model": {"style": "rule", "ground_truth": ref},
             "extra_info": {"index": i, "raw_problem": f"{source} problem {i}"}} for i, ref in enumerate(references)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_rft_samples_eval_and_rft_data_through_a_stub_vllm(tmp_path: Path, stub_env: dict) -> None:
    """The stub's k-th sample of a prompt ends in \\boxed{k}: with n = 4, a reference "2" or "0" is right once, "9"
    never. aime24 (references 2, 9): avg@4 = 1/8, pass@k = (k/4 + 0)/2; aime25 (0, 3): avg@4 = 1/4, pass@k = k/4."""
    from predmask.verl.vr_sft import build_final_data
    from sweeps.datasets import prepare_variational

    data = tmp_path / "data"
    prepare_variational(data, bespoke_file=REPO / "tests" / "fixtures" / "bespoke_stratos" / "bespoke_stratos_tiny.jsonl")
    _eval_file(data / "aime24.parquet", "aime24", ["2", "9"])
    _eval_file(data / "aime25.parquet", "aime25", ["0", "3"])
    questions = pq.read_table(data / VR_DATA_FILES["questions"]).to_pylist()
    sweep = tmp_path / "sweep"
    prior_hf = _hf_export(sweep / "r-prior" / "checkpoints", (1,), 1)
    final_hf = _hf_export(sweep / "r-final" / "checkpoints", (4,), 4)
    shape = {"nodes": 1, "gpus_per_node": 2, "data_dir": str(data)}

    stub_env["log"].unlink(missing_ok=True)
    argv = stage_command(cfg("rft_samples", **shape, variational={"data_dir": str(data), "rft": {"samples": 8}}),
                         sweep / "r-rft", sys.executable)
    proc = _sample(stub_env, *argv[3:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {json.loads(line)["model"] for line in stub_env["log"].read_text().splitlines()} == {str(prior_hf)}
    samples = pq.read_table(sweep / "r-rft" / "rft_samples.parquet").to_pylist()
    assert [(s["question"], s["trace"]) for s in samples] == [(q, j) for q in range(4) for j in range(8)]
    for s in samples:
        assert s["correct"] == (questions[s["question"]]["reference_answer"] == str(s["trace"]))
    train = tmp_path / "final_sft.parquet"
    build_final_data({"recipe": "rft", "samples_file": str(sweep / "r-rft" / "rft_samples.parquet"),
                      "questions_file": str(data / VR_DATA_FILES["questions"]), "train_file": str(train)})
    rows = pq.read_table(train).to_pylist()
    assert [(r["question"], r["trace"], r["weight"]) for r in rows] == [
        (s["question"], s["trace"], 1 / 8) for s in samples if s["correct"]] and rows  # question 3: \boxed{5}

    for method, model in (({"name": "prior"}, prior_hf), ({"name": "rft"}, final_hf)):
        stub_env["log"].unlink(missing_ok=True)
        run = sweep / f"r-eval-{method['name']}"
        argv = stage_command(cfg("eval", method, **shape, variational={"data_dir": str(data), "eval": {"n": 4}}),
                             run, sys.executable)
        proc = _sample(stub_env, *argv[3:])
        assert proc.returncode == 0, proc.stderr[-3000:]
        calls = [json.loads(line) for line in stub_env["log"].read_text().splitlines()]
        assert {c["model"] for c in calls} == {str(model)} and sorted(c["gpus"] for c in calls) == ["0", "1"]
        (line,) = (run / "metrics.jsonl").read_text().splitlines()
        record = json.loads(line)
        assert record["step"] == 0
        length = len("<|begin_of_thought|>\n\nstep 0 of 0\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\n"
                     "\\boxed{0}\n\n<|end_of_solution|>")  # the stub's every sample, one token per character
        expect = {M.val_acc("aime24", 4): 1 / 8, M.val_acc("aime25", 4): 1 / 4,
                  M.val_response_length("aime24"): length, M.val_response_length("aime25"): length}
        expect.update({M.val_pass("aime24", k): k / 8 for k in range(1, 5)})
        expect.update({M.val_pass("aime25", k): k / 4 for k in range(1, 5)})
        assert record["data"] == pytest.approx(expect, rel=1e-12)

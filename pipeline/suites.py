"""Quality suites: which exist, how each becomes an lm-eval task in a run, and how its items are sliced.

A suite is an lm-eval task YAML in `evalsuites/` over local data (multiple choice scored by
loglikelihood, or generation scored by `evalsuites/qe_utils.py`), a user's own lm-eval task
YAML given by path, or `drift`: perplexity and token-level KL against the baseline from the
engine's logprobs (pipeline-native, not an lm-eval task). Rendering a suite into a run
copies its YAML (and `qe_utils.py`) into the run's task folder with its data file, cut to
the recipe's size; generative prompts are rendered with the model's own chat template, so
they are per run.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline import suitetable
from pipeline.runstore import atomic_write_text
from pipeline.setup import assets

EVALSUITES = Path(__file__).resolve().parent.parent / "evalsuites"
# prompt-length buckets (tokens), a slice on every suite
BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Suite:
    name: str  # the slice family name in results (a builtin name, or a user task's `task:`)
    kind: str  # mc | gen | drift | user
    yaml_path: Path | None

    @property
    def task(self) -> str:
        return f"qe_{self.name}" if self.kind != "user" else self.name


def utils_module():
    spec = importlib.util.spec_from_file_location("qe_utils", EVALSUITES / "qe_utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _TaskLoader(yaml.SafeLoader):
    """Reads lm-eval task YAML, whose `!function` tags the safe loader does not know."""


_TaskLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


# stop strings a task may list: vLLM's OpenAI server refuses more than 4 in a request, and lm-eval adds the
# model's EOS to the task's list where it is not already there
MAX_STOP = 3


def read_task_yaml(path: Path) -> dict:
    data = yaml.load(path.read_text(), Loader=_TaskLoader)  # noqa: S506 - a SafeLoader subclass
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an lm-eval task YAML must be a mapping")
    return data


def user_task(path: Path) -> Suite:
    """A user's lm-eval task YAML; raises ValueError with a one-line reason."""
    if not path.is_file():
        raise ValueError(f"{path}: task YAML not found")
    try:
        data = read_task_yaml(path)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    name = data.get("task")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}: no `task:` name (only single-task YAMLs drop in, not groups)")
    if "include" in data:
        raise ValueError(f"{path}: `include:` of another YAML is not supported; inline it")
    if data.get("output_type", "generate_until") not in ("multiple_choice", "generate_until", "loglikelihood"):
        raise ValueError(f"{path}: output_type {data.get('output_type')!r} is not scored per item here")
    until = (data.get("generation_kwargs") or {}).get("until") or []
    if isinstance(until, list) and len(until) > MAX_STOP:
        raise ValueError(f"{path}: generation_kwargs.until has {len(until)} stop strings; at most {MAX_STOP} (the "
                         "engine's OpenAI endpoint takes 4, and lm-eval adds the model's end-of-sequence token)")
    return Suite(name=name, kind="user", yaml_path=path.resolve())


def user_slices(suite: Suite, max_bytes: int = 256 << 20) -> dict[str, set[str]] | None:
    """The slice dimensions and values a user task's items carry (each doc's `slices` mapping), read
    from its local JSON/JSONL data before a run; None when that cannot be known without lm-eval
    (remote data, a `process_docs` that may rewrite docs, another format, or too large to read)."""
    data = read_task_yaml(suite.yaml_path)
    if "process_docs" in data:
        return None
    files = (data.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        split = data.get("test_split") or data.get("validation_split")
        files = files.get(split) if split else None
    if not files:
        return None
    out: dict[str, set[str]] = {}
    for f in files if isinstance(files, list) else [files]:
        path = next((c for c in (Path(str(f)), suite.yaml_path.parent / str(f)) if c.is_file()), None)
        if path is None or path.suffix not in (".json", ".jsonl") or path.stat().st_size > max_bytes:
            return None
        text = path.read_text(errors="replace")
        try:
            docs = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
        except json.JSONDecodeError:
            return None
        if isinstance(docs, dict):  # {"data": [...]}-style files: lm-eval reads them through `field`
            docs = docs.get((data.get("dataset_kwargs") or {}).get("field", "data"), [])
        for doc in docs if isinstance(docs, list) else []:
            for dim, val in ((doc.get("slices") or {}) if isinstance(doc, dict) else {}).items():
                out.setdefault(str(dim), set()).add(str(val))
    return out


def resolve(entries, base_dir: Path | None = None) -> list[Suite]:
    out = []
    for e in entries:
        if e in suitetable.SUITES:
            kind = suitetable.SUITES[e].kind
            out.append(Suite(e, kind, None if kind == "drift" else EVALSUITES / f"{e}.yaml"))
        else:
            p = Path(e)
            out.append(user_task(p if p.is_absolute() or base_dir is None else base_dir / p))
    return out


def _uses_utils(suite: Suite) -> bool:
    """A builtin task that calls evalsuites/qe_utils.py: every generative one, and a multiple-choice one whose
    YAML names it (Winogrande's contexts): it needs the file beside it, and its key needs its bytes."""
    return suite.kind == "gen" or (suite.kind == "mc" and suite.yaml_path is not None
                                   and "qe_utils." in suite.yaml_path.read_text())


def definition_hash(suite: Suite) -> str:
    """Everything that defines a suite's items and scoring, for the quality key."""
    h = hashlib.sha256()
    if suite.yaml_path is not None:
        h.update(suite.yaml_path.read_bytes())
    if suite.kind == "drift" or _uses_utils(suite):
        h.update((EVALSUITES / "qe_utils.py").read_bytes())
    if suite.kind in ("gen", "drift"):  # prompts (chat template, BFCL system text, haystacks) are built here
        h.update(Path(__file__).read_bytes())
    if suite.kind == "user":
        for py in sorted(suite.yaml_path.parent.glob("*.py")):
            h.update(py.name.encode() + py.read_bytes())
        files = (read_task_yaml(suite.yaml_path).get("dataset_kwargs") or {}).get("data_files") or {}
        for f in sorted(files.values() if isinstance(files, dict) else [files], key=str):
            for one in f if isinstance(f, list) else [f]:
                if isinstance(one, str) and Path(one).is_file():  # local data: its bytes are the items
                    h.update(Path(one).read_bytes())
    source = suitetable.SUITES[suite.name].source if suite.kind != "user" else None
    if source is not None and not source.per_run:
        h.update(assets.data_version(suite.name).encode())
    if source is not None and source.per_run:
        h.update(f"{assets.NEEDLE.name}=={assets.NEEDLE.version} {assets.NEEDLE.sha256}".encode())
    return h.hexdigest()


# the builtin suites whose prompts render() builds through the model's own chat template (the template itself
# is in the tokenizer files, so model.tokenizer_sha256 pins it); the rest are lm-eval's plain prompts
CHAT_TEMPLATE = ("asdiv", "gsm8k", "bfcl", "needle", "harmbench")


def settings(suite: Suite) -> dict:
    """What makes two runs' scores of this suite comparable, for the manifest (`compare` calls any difference
    not like for like): its task definition's hash, the output type, few-shot count (every lm-eval call of
    the quality stage is zero-shot), whether the prompt goes through the chat template, the stop strings,
    max_gen_toks and the other generation settings, and the data's pin."""
    cfg = read_task_yaml(suite.yaml_path) if suite.yaml_path is not None else {}
    gen = dict(cfg.get("generation_kwargs") or {})
    out = {"kind": suite.kind, "definition": definition_hash(suite), "output_type": cfg.get("output_type"),
           "num_fewshot": 0, "chat_template": suite.kind != "user" and suite.name in CHAT_TEMPLATE,
           "until": list(gen.pop("until", None) or []), "max_gen_toks": gen.pop("max_gen_toks", None),
           "generation": gen}
    if suite.name in suitetable.EXTRACTED and suite.kind != "user":
        out["data"] = assets.data_version(suite.name)
    return out


def bucket(tokens: int) -> str:
    lo = 0
    for hi in BUCKETS:
        if tokens < hi:
            return f"{lo}-{hi - 1} tok"
        lo = hi
    return f">={lo} tok"


# --- rendering a suite into a run's task folder ----------------------------------------------

def chat(tokenizer, system: str | None, user: str) -> str:
    """The prompt as the model is served: its chat template if it has one, else plain text."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # a template that writes <bos> itself, for a tokenizer that adds one too: the request gets one
        bos = tokenizer.bos_token if bos_prefix(tokenizer) is not None else None
        return text[len(bos):] if bos and text.startswith(bos) else text
    return (f"{system}\n\n" if system else "") + f"{user}\nAnswer:"


def _asdiv_prompts(rows: list[dict], tok) -> list[dict]:
    for r in rows:
        r["prompt"] = chat(tok, None, f"{r['question']}\nSolve it and end with: The answer is <number>.")
    return rows


# lm-eval's gsm8k_cot_llama instruction, asked zero-shot through the model's chat template
GSM8K_INSTRUCTION = ("Given the following problem, reason and give a final answer to the problem.\nProblem: {question}\n"
                     "Your response should end with \"The final answer is [answer]\" where [answer] is the response "
                     "to the problem.\n")


def _gsm8k_prompts(rows: list[dict], tok) -> list[dict]:
    for r in rows:
        r["prompt"] = chat(tok, None, GSM8K_INSTRUCTION.format(question=r["question"]))
    return rows


BFCL_SYSTEM = ("You can call these functions (JSON schema):\n{functions}\n\nIf one of them fits the user's "
               "request, reply with only the call as JSON: {{\"name\": <function name>, \"arguments\": "
               "{{<argument>: <value>, ...}}}}. If none fits, reply NONE.")


def _bfcl_prompts(rows: list[dict], tok) -> list[dict]:
    for r in rows:
        r["prompt"] = chat(tok, BFCL_SYSTEM.format(functions=r["functions_json"]), r["question"])
    return rows


CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tromso", "Adelaide", "Krakow", "Montreal", "Cusco", "Hanoi",
          "Bergen", "Tbilisi")
WORDS = ("marigold", "telescope", "pinecone", "saxophone", "lighthouse", "avalanche", "cinnamon", "hammock",
         "porcupine", "velvet", "harmonica", "tangerine")


_CORPORA: dict[tuple, tuple[list[int], list[str] | None]] = {}


def bos_prefix(tok) -> int | None:
    """The token the model's own tokenizer puts before every text (Gemma's <bos>), or None (SmolLM2 puts
    none). lm-eval's API backend adds nothing unless told, and a model trained to see <bos> first scores
    near chance without it, so prompts are served as the tokenizer makes them."""
    bos = getattr(tok, "bos_token_id", None)
    plain = tok("a", add_special_tokens=False)["input_ids"]
    # only a <bos> in front: a tokenizer that also appends <eos> would end every context with it
    return bos if bos is not None and tok("a")["input_ids"] == [bos, *plain] else None


def corpus(tok, domain: str) -> tuple[list[int], list[str] | None]:
    """A corpus's documents as one token stream, tokenized once, and the document each token comes from
    ('essays/<name>', 'code/HumanEval/12'); None where the tokenizer gives no character offsets (a slow one)."""
    key = (domain, tok.name_or_path, len(tok))  # not id(): a freed tokenizer's id can be reused
    if key not in _CORPORA:
        docs = assets.essays() if domain == "essays" else assets.code_docs()
        text = "\n\n".join(t for _, t in docs)
        starts = [0]
        for _, t in docs[:-1]:
            starts.append(starts[-1] + len(t) + 2)
        if getattr(tok, "is_fast", False):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            names = [f"{domain}/{docs[bisect.bisect_right(starts, a) - 1][0]}" for a, _ in enc["offset_mapping"]]
        else:
            enc, names = tok(text, add_special_tokens=False), None
        _CORPORA[key] = (enc["input_ids"], names)
    return _CORPORA[key]


def essay_ids(tok) -> list[int]:
    """The packaged essays as one token stream (haystacks and the drift corpus), tokenized once."""
    return corpus(tok, "essays")[0]


def needle_rows(tok, context_tokens: tuple[int, ...], depths: tuple[float, ...], per_cell: int) -> list[dict]:
    """Haystacks of exact token lengths cut from the packaged essays, a needle sentence inserted at
    each depth (at the nearest sentence start), per_cell different needles per (length, depth)."""
    ids = essay_ids(tok)
    rng = random.Random(0)
    rows, offset = [], 0
    for _ in range(per_cell):  # cell by cell, so a limit keeps every length and depth
        for length in context_tokens:
            for depth in depths:
                if offset + length > len(ids):
                    offset = 0
                hay = tok.decode(ids[offset:offset + length])
                offset += length
                cut = int(len(hay) * depth)
                dot = hay.rfind(". ", 0, cut)
                cut = 0 if depth == 0 or dot < 0 else dot + 2
                city, word = CITIES[len(rows) % len(CITIES)], rng.choice(WORDS)
                needle = f"The secret code word for {city} is {word}."
                body = hay[:cut] + needle + " " + hay[cut:]
                question = f"What is the secret code word for {city}? Reply with the word only."
                rows.append({"id": len(rows), "needle_answer": word, "context_tokens": length, "depth": depth,
                             "prompt": chat(tok, None, f"{body}\n\n{question}"),
                             "slices": {"context": f"{length} tok", "depth": f"{int(depth * 100)}%"}})
    return rows


def render(suite: Suite, out_dir: Path, tok, quality, limit: int | None) -> Path:
    """The suite's task YAML in the run's task folder, its data file cut to `limit` items."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if suite.kind == "user":  # its own folder: two tasks' utils.py must not overwrite each other
        own = out_dir / f"user-{suite.name}"
        own.mkdir(parents=True, exist_ok=True)
        for f in suite.yaml_path.parent.glob("*.py"):  # !function helpers sit beside the YAML
            atomic_write_text(own / f.name, f.read_text())
        target = own / f"{suite.name}.yaml"
        atomic_write_text(target, suite.yaml_path.read_text())
        return target
    if suite.name == "needle":
        n = quality.needle
        rows = needle_rows(tok, n.context_tokens, n.depths, n.per_cell)
    else:
        with open(assets.suite_data(suite.name)) as f:
            rows = [json.loads(line) for line in f]
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"suite {suite.name}: no items to score")
    if suite.name == "asdiv":
        rows = _asdiv_prompts(rows, tok)
    elif suite.name == "bfcl":
        rows = _bfcl_prompts(rows, tok)
    elif suite.name == "gsm8k":
        rows = _gsm8k_prompts(rows, tok)
    elif suite.name == "harmbench":  # the request as the user's message, nothing added
        rows = [{**r, "prompt": chat(tok, None, r["question"])} for r in rows]
    data = out_dir / f"qe_{suite.name}.jsonl"
    atomic_write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
    if _uses_utils(suite):
        atomic_write_text(out_dir / "qe_utils.py", (EVALSUITES / "qe_utils.py").read_text())
    target = out_dir / f"qe_{suite.name}.yaml"
    atomic_write_text(target, suite.yaml_path.read_text().replace("{data}", str(data)))
    return target

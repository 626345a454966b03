"""The built-in ``search_qa`` task: short knowledge questions in the Search-R1 / SSRL prompt format, offline.

SSRL (Fan et al. 2025, arXiv 2508.10874; rollout/self_search.py) trains the policy to answer with ``<think>``,
``<search>``, ``<information>`` and ``<answer>`` blocks, writing the information itself; with
``rollout.self_search.sim2real`` the evaluation fills the information from the search tool's corpus. The questions
here are answered by the packaged demo corpus (data/search_demo_corpus.py), so that both modes run without a
download: self-search during training, BM25 over the demo corpus at evaluation. Answers are short strings for
``qa_exact_match`` (rewards/ssrl_format.py).

The prompt's wording is this library's own (the authors' prompt text was not used); what it must say follows the
method: reason in think blocks, write a query in search blocks, then the information it finds (the policy's own
knowledge when no engine answers) in information blocks, and the final short answer in an answer block.

Splits: the last ``task.eval_size`` questions (at most half of them) are held out, the others train, at most
``task.train_size``. A real run uses its own QA file (``task.name=file``) with :data:`SSRL_TEMPLATE` as the
instruction's model.
"""

from __future__ import annotations

from anabranch.config import TaskConfig
from anabranch.data.tasks import TASKS

SSRL_TEMPLATE = (
    "Answer the question below. First reason inside <think> and </think>. Whenever you lack a fact, write a search "
    "query inside <search> and </search>, then the information that search finds inside <information> and "
    "</information>; reason again inside <think> and </think> after new information. You may search as many times "
    "as you need. When you know the answer, write it inside <answer> and </answer>, a few words only, for example "
    "<answer> Paris </answer>.\nQuestion: {question}"
)

# (question, answer): each answered by a passage of the demo corpus.
QA = [
    ("What is the highest mountain above sea level?", "Mount Everest"),
    ("In which mountain range does Mount Everest lie?", "Himalayas"),
    ("From which country was the mountaineer Edmund Hillary?", "New Zealand"),
    ("In which year did Hillary and Tenzing Norgay first reach the summit of Everest?", "1953"),
    ("In which city was Marie Curie born?", "Warsaw"),
    ("What is the atomic number of polonium?", "84"),
    ("After which country is the element polonium named?", "Poland"),
    ("On which river does Warsaw stand?", "Vistula"),
    ("Into which sea does the Vistula flow?", "Baltic Sea"),
    ("Whose machine did Ada Lovelace write her famous notes about?", "Charles Babbage"),
    ("In which city was Charles Babbage born?", "London"),
    ("In which year did Charles Babbage design the Analytical Engine?", "1837"),
    ("What is the largest coral reef system in the world?", "Great Barrier Reef"),
    ("Off the coast of which Australian state does the Great Barrier Reef lie?", "Queensland"),
    ("What is the capital of Queensland?", "Brisbane"),
    ("In which year did Marie Curie win the Nobel Prize in chemistry?", "1911"),
]


def prompt_text(question: str, template: str = SSRL_TEMPLATE) -> str:
    return template.replace("{question}", question.strip())


@TASKS.register("search_qa")
def search_qa(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    rows = [{"question": prompt_text(q), "answer": a} for q, a in QA]
    held = min(max(cfg.eval_size, 0), len(rows) // 2)
    train, test = rows[:len(rows) - held], rows[len(rows) - held:]
    return train[:max(cfg.train_size, 1)], test

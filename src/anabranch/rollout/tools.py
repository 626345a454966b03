"""Tools a policy can call in a multi-turn rollout (:mod:`anabranch.rollout.multi_turn`).

A tool is a name, a one-line description the prompt shows the model, and a function from the text
the model wrote between ``<name>`` and ``</name>`` to the text it gets back. ``rollout.tools`` names
them: the built-in ``calculator`` and ``python``, or a user's ``package.module:function`` (a function
``f(text: str) -> str``; its name is the tag, the first line of its docstring the description).

* ``calculator``: one arithmetic expression (numbers, ``+ - * / // % **``, parentheses and a few
  functions: ``sqrt abs round min max``), evaluated exactly as Python would, without ``eval``.
* ``python``: a program run in the code sandbox (:mod:`anabranch.rewards.sandbox`: no network, no
  writes outside a scratch folder, time, memory and process limits); the output is what it prints,
  plus the value of a final bare expression as a notebook cell shows it, or the exception it raised.
  This is the tool of tool-integrated reasoning RL (ToRL, Li et al. 2025, "ToRL: Scaling
  Tool-Integrated RL"; ReTool, Feng et al. 2025).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Callable

from anabranch.config import ConfigError
from anabranch.registry import Registry

TOOLS: Registry = Registry("tool")


@dataclass(frozen=True)
class Tool:
    name: str                    # the tag: <name>input</name>
    description: str             # one line, shown to the model in the tool instructions
    run: Callable[[str], str]    # the call's input text -> the output text
    example: tuple | None = None  # (question, input, output) of a worked example for the instructions

    @property
    def open_tag(self) -> str:
        return f"<{self.name}>"

    @property
    def close_tag(self) -> str:
        return f"</{self.name}>"


class ToolError(Exception):
    """A call the tool cannot answer; its message is the output the model sees (after "error: ")."""


# ---------------------------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
# Bounds that keep one call cheap: 10**10**9 would take the trainer's process minutes and gigabytes.
MAX_EXPONENT = 1000
MAX_DIGITS = 4300  # Python's own limit on int <-> str conversion


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT and abs(left) not in (0, 1):
            raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ToolError("the result is too large")
        return value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*[_evaluate(a) for a in node.args])
    raise ToolError(f"not an arithmetic expression: {ast.unparse(node)!r}")


def format_number(value) -> str:
    """Integers as they are; floats to 12 significant digits (0.1 + 0.2 shows as 0.3), integral ones
    without a fraction (7.0 shows as 7)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def calculate(expression: str) -> str:
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise ToolError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression.strip()!r}") from None
    try:
        return format_number(_evaluate(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise ToolError(str(exc)) from None


@TOOLS.register("calculator")
def calculator_tool(timeout_s: float = 10.0) -> Tool:
    return Tool("calculator", "evaluates one arithmetic expression", calculate,
                example=("What is 12*(3+4)?", "12*(3+4)", "84"))


# ---------------------------------------------------------------------------------------------- python
def notebook_cell(code: str) -> str:
    """``code`` with a final bare expression printed, as a notebook shows a cell's value (a final
    ``print(...)`` call, or an expression whose value is None, prints nothing more)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # the sandbox reports the SyntaxError itself
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or (isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
                                          and last.value.func.id == "print"):
        return code
    show = f"__value = ({ast.unparse(last.value)})\nif __value is not None:\n    print(repr(__value))"
    tree.body[-1:] = ast.parse(show).body
    return ast.unparse(tree) + "\n"


@TOOLS.register("python")
def python_tool(timeout_s: float = 10.0) -> Tool:
    from anabranch.rewards.sandbox import SandboxLimits, run_tests

    limits = SandboxLimits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)), output_kb=16)

    def run(code: str) -> str:
        res = run_tests(notebook_cell(_strip_fence(code)), [], limits=limits)
        out = res.program_stdout
        if res.timed_out:
            return f"{out}error: timed out after {timeout_s:g} s".strip()
        if res.error and not res.error.startswith("program raised"):
            return f"{out}error: {res.error}".strip()
        if res.error:  # the exception's last traceback line, as an interpreter prints it
            last = [line for line in res.stderr.splitlines() if line.strip()]
            return f"{out}{last[-1] if last else res.error}".strip()
        return out.rstrip("\n")

    return Tool("python", "runs a Python program and shows what it prints", run,
                example=("What is the sum of the squares of 1 to 10?", "print(sum(i * i for i in range(1, 11)))",
                         "385"))


def _strip_fence(code: str) -> str:
    """The code inside a Markdown fence, if the model wrapped its call in one."""
    text = code.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        body = text[3:-3]
        first, _, rest = body.partition("\n")
        return rest if first.strip().isidentifier() or not first.strip() else body
    return code


# ---------------------------------------------------------------------------------------------- lookup
def build_tools(names: list, timeout_s: float = 10.0) -> list[Tool]:
    """The tools of ``rollout.tools``, errors naming the key."""
    tools = []
    for i, name in enumerate(names):
        key = f"rollout.tools[{i}]"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: expected a tool name (calculator, python or package.module:function), "
                              f"got {name!r}")
        try:
            factory = TOOLS.get(name)
        except (KeyError, ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc.args[0]}") from None
        if name in TOOLS:
            tool = factory(timeout_s=timeout_s)
        else:  # a user's function: its name is the tag
            if not callable(factory):
                raise ConfigError(f"{key}: {name!r} is not a function")
            doc = (factory.__doc__ or "").strip().splitlines()
            tool = Tool(factory.__name__, doc[0] if doc else f"the tool {factory.__name__}", factory)
        if not tool.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{key}: the tag {tool.name!r} must be letters, digits, '_' or '-'")
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"{key}: a second tool named {tool.name!r}")
        tools.append(tool)
    return tools


def tool_instructions(tools: list[Tool], result_tag: str = "result") -> str:
    """What the prompt tells the model about its tools (``rollout.tool_instructions``): the call
    format, one line per tool, and a worked example (the first tool that has one), since small
    models follow an example far more often than a description."""
    lines = [f"You can use tools. To call one, write <name>input</name>; its output comes back as "
             f"<{result_tag}>output</{result_tag}>, then continue. Tools:"]
    lines += [f"- {t.name}: {t.description}" for t in tools]
    shown = next((t for t in tools if t.example), None)
    if shown is not None:
        question, arg, output = shown.example
        lines += ["Example:", f"Question: {question}",
                  f"{shown.open_tag}{arg}{shown.close_tag}\n<{result_tag}>\n{output}\n</{result_tag}>\n"
                  f"The answer is {output}."]
    return "\n".join(lines)

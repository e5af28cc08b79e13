"""Reference trajectories: every OOLONG-synth question kind and scope, run in the jailed REPL
against the simulated sub-model, answers its question exactly."""

import anyio
import pytest

from agentrt import Agent, ReplayEngine
from agentrt.engine import OpenAIEngine
from agentrt.engine.base import SamplingParams
from agentrt.llm_tools import make_llm_tools
from benchmarks.oolong.generate import generate
from benchmarks.oolong.questions import QUESTION_KINDS, SCOPES_OF, UnknownQuestionError
from benchmarks.oolong.scoring import score
from benchmarks.oolong.server import Oracle, SimulatedSubModel
from benchmarks.oolong.trajectories import STYLES, TURNS, shape_of, trajectory

PINNED = [f"{kind}@{scope}" for kind in QUESTION_KINDS for scope in SCOPES_OF.get(kind, ("all",))]


async def _run(tasks, styles, at_once=4):
    """Each task's agent run (``at_once`` of them at a time: most of a run is waiting)."""
    results = [None] * len(tasks)
    limit = anyio.Semaphore(at_once)
    with SimulatedSubModel(Oracle.from_tasks(tasks)) as sub_model:
        async def one(i):
            async with limit:
                sub = OpenAIEngine(base_url=f"{sub_model.url}/v1", model="m", server_metrics=False)
                agent = Agent(ReplayEngine(trajectory(tasks[i], styles[i]), tokens_per_second=5000),
                              tools=make_llm_tools(sub, SamplingParams(max_tokens=8192)),
                              builtin_tools=False, max_turns=6)
                try:
                    results[i] = await agent.run("question", tasks[i].context)
                finally:
                    await sub.aclose()

        async with anyio.create_task_group() as group:
            for i in range(len(tasks)):
                group.start_soon(one, i)
    return results


def test_every_kind_and_scope_is_answered_exactly():
    tasks = generate([1536], len(PINNED), seed=11, kinds=PINNED)
    assert {(t.task, t.question.split(",")[0]) for t in tasks}  # generated in every scope
    styles = [STYLES[i % len(STYLES)] for i in range(len(tasks))]
    results = anyio.run(_run, tasks, styles)
    for task, style, result in zip(tasks, styles, results):
        assert result.status == "final", (task.id, style, result.error,
                                          [t.error for t in result.turns])
        assert score(str(result.answer), task.answer, task.answer_type) == 1.0, (
            task.id, task.question, style, result.answer, task.answer)
        assert len(result.turns) == TURNS[style]
        code = "\n".join(t.code for t in result.turns)
        assert shape_of(code) == ("batched" if "batched" in style else "loop")


def test_parameters_come_from_the_question_text():
    (task,) = generate([1024], 1, seed=2, kinds=["label_count"])
    label = next(lab for lab in task.labels if f"'{lab}'" in task.question)
    other = next(lab for lab in task.labels if lab != label)
    moved = type(task)(**{**task.__dict__, "question": task.question.replace(label, other)})
    def counted(t):
        (reply,) = trajectory(t, "small")
        return next(line for line in reply.splitlines() if "scoped_labels.count(" in line)

    assert f'count("{label}")' in counted(task)
    assert f'count("{other}")' in counted(moved)


def test_unknown_question_names_the_known_kinds():
    (task,) = generate([1024], 1, seed=2)
    odd = type(task)(**{**task.__dict__, "question": "How tall is the tallest user?"})
    with pytest.raises(UnknownQuestionError, match="known kinds: most_common_label"):
        trajectory(odd, "batched")
    with pytest.raises(ValueError, match="unknown style"):
        trajectory(task, "fancy")

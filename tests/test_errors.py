"""One error root: every exception class the five packages define derives from
`agentrt.AgentrtError` (found by importing every module), except the few that are interrupts on
purpose; catching `AgentrtError` catches an engine's error and the REPL's."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import agentrt
from agentrt import AgentrtError, EngineError, ReplError

PACKAGES = ("agentrt", "agentrt.tools", "agentrt.interpreter", "agentrt.engine", "agentrt.kernels")

INTERRUPTS = {
    # Must pass ``except Exception`` clauses: a KeyboardInterrupt, and the lazy values' abandon
    # signal (a ShadowStopped is one).
    "agentrt.results.RunInterrupted",
    "agentrt.interpreter.lazy_values.Abandoned",
    "agentrt.interpreter.shadow_worker.ShadowStopped",
}
"""BaseException subclasses that are deliberately not errors (nor `AgentrtError`)."""

def project_modules() -> list[str]:
    names = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.add(package)
        names |= {info.name for info in pkgutil.walk_packages(module.__path__, package + ".")}
    return sorted(names)


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined (at module level) in the project's packages, by
    ``module.name`` (the name in the module's namespace: a class may rename itself)."""
    found = {}
    for name in project_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) \
                    and value.__module__ == name:
                found[f"{name}.{attr}"] = value
    return found


def test_the_walk_finds_the_known_errors():
    found = exception_classes()
    for name in ("agentrt.engine.base.EngineError", "agentrt.interpreter.repl.results.ReplError",
                 "agentrt.tools.errors.ToolError", "agentrt.serve_limits.RequestError",
                 "agentrt.interpreter.jail.JailUnavailable",
                 "agentrt.interpreter.sandbox.admission.AdmissionError",
                 "agentrt.interpreter.sandbox.policy.SandboxSyntaxError"):
        assert name in found
    assert len(found) > 25


def test_every_project_error_derives_from_agentrt_error():
    found = exception_classes()
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, AgentrtError) and name not in INTERRUPTS)
    assert not outside, f"errors that do not derive from AgentrtError: {outside}"
    for name in INTERRUPTS:
        assert name in found and not issubclass(found[name], Exception), name


def test_agentrt_error_is_exported_with_the_layers_errors():
    for name in ("AgentrtError", "EngineError", "ReplError", "ToolError"):
        assert name in agentrt.__all__
    assert issubclass(agentrt.ToolError, AgentrtError)
    assert not issubclass(agentrt.RunInterrupted, Exception)


@pytest.mark.parametrize(("error", "builtin"), [(EngineError("x"), RuntimeError),
                                                 (ReplError("x"), RuntimeError)])
def test_catching_agentrt_error_catches_an_engine_and_a_repl_error(error, builtin):
    with pytest.raises(AgentrtError):
        raise error
    with pytest.raises(builtin):  # the builtin base callers relied on stays
        raise error


def test_errors_raised_by_the_engine_and_the_interpreter_are_caught_as_agentrt_error():
    from agentrt.engine.models import ModelNotFoundError, gguf_file_path
    from agentrt.interpreter.protocol import ProtocolError, decode_untrusted

    with pytest.raises(AgentrtError) as engine_error:
        gguf_file_path("no-such-model")
    assert isinstance(engine_error.value, ModelNotFoundError)
    assert isinstance(engine_error.value, EngineError)
    with pytest.raises(AgentrtError) as interpreter_error:
        decode_untrusted(b"not a pickle")
    assert isinstance(interpreter_error.value, ProtocolError)

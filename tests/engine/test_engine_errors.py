"""Every error gpu_engine defines derives from gpu_engine.errors.EngineError, and exactly the request-level ones
from InvalidRequestError (the class workers/failures.py treats as permanent: no retry)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import gpu_engine
from gpu_engine.errors import EngineError, InvalidRequestError


def _engine_exceptions() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(gpu_engine.__path__, "gpu_engine."):
        if info.name == "gpu_engine.__main__":
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_engine_error_derives_from_engine_error():
    errors = _engine_exceptions()
    assert len(errors) >= 27  # the count when the base was introduced (issue #18)
    assert [e.__qualname__ for e in errors if not issubclass(e, EngineError)] == []


def test_only_request_level_errors_are_invalid_requests():
    invalid = {e.__name__ for e in _engine_exceptions() if issubclass(e, InvalidRequestError)}
    assert {"RequestError", "ProcessorError", "GrammarError", "DataUrlError"} <= invalid
    assert not invalid & {"RunnerInputError", "ModelLoadError", "CudaBackendError", "EngineStoppedError",
                          "EngineConfigError", "TokenizerError", "RunnerUnavailableError", "VisionTowerError"}

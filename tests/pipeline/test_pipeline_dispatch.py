"""pipeline.dispatch: the broker producer is found through its entry point, never imported by name."""
from __future__ import annotations

from importlib import metadata

import pytest

from pipeline.dispatch import DISPATCH_GROUP, Dispatcher, DispatchUnavailableError, broker_dispatcher
from pipeline.settings import Settings


def test_no_registered_broker_is_an_error_in_words(tmp_path):
    settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0")
    with pytest.raises(DispatchUnavailableError, match="docpipe.dispatch"):
        broker_dispatcher(settings, entry_points=[])


def test_the_entry_point_named_broker_builds_the_dispatcher(tmp_path, monkeypatch):
    settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0")
    sent: list[int] = []

    def factory(s: Settings) -> Dispatcher:
        assert s is settings
        return Dispatcher(send=sent.append, ping=lambda: None)

    import types
    module = types.ModuleType("fake_dispatch_plugin")
    module.factory = factory  # type: ignore[attr-defined]  # a stand-in module
    monkeypatch.setitem(__import__("sys").modules, "fake_dispatch_plugin", module)
    eps = [metadata.EntryPoint("other", "fake_dispatch_plugin:nothing", DISPATCH_GROUP),
           metadata.EntryPoint("broker", "fake_dispatch_plugin:factory", DISPATCH_GROUP)]
    dispatcher = broker_dispatcher(settings, entry_points=eps)
    dispatcher.send(7)
    assert sent == [7]


def test_docpipe_registers_the_celery_dispatcher():
    names = {(ep.name, ep.value) for ep in metadata.entry_points(group=DISPATCH_GROUP)}
    assert ("broker", "workers.dispatch:broker_dispatcher") in names

"""hyflow.registry.Registry: register (decorator or call), lazy entries imported on first get, closest-name errors,
names() without importing, and the mapping protocol the older dict registries offered."""

from __future__ import annotations

import sys

import pytest

from hyflow.registry import Registry, UnknownNameError


def test_register_as_decorator_and_as_call():
    registry = Registry("widget")

    @registry.register("a")
    def a():
        return "a"

    def b():
        return "b"

    assert registry.register("b", b) is b
    assert registry.get("a") is a and registry["b"] is b
    assert registry.names() == ["a", "b"] and list(registry) == ["a", "b"] and len(registry) == 2
    registry.register("a", a)  # the same object again: no-op
    with pytest.raises(ValueError, match=r"widget 'a' is already registered \(by .*a\); pick another name"):
        registry.register("a", b)


def test_unknown_name_names_the_closest_and_is_both_key_and_value_error():
    registry = Registry("widget", hint="Register one with @WIDGETS.register(name).")
    registry.register("sprocket", object())
    registry.register("gear", object())
    with pytest.raises(KeyError) as info:
        registry.get("sprockett")
    assert isinstance(info.value, ValueError) and isinstance(info.value, UnknownNameError)
    assert str(info.value) == ("unknown widget 'sprockett'. Did you mean 'sprocket'? Known: gear, sprocket. "
                               "Register one with @WIDGETS.register(name).")
    assert "Did you mean" not in str(registry.unknown("zzz", " (the config key)"))
    assert str(registry.unknown("zzz", " (the config key)")).startswith("unknown widget 'zzz' (the config key).")
    assert registry.get("nothing", None) is None


def test_lazy_entry_is_imported_on_first_get_only(tmp_path, monkeypatch):
    (tmp_path / "lazy_widget_module.py").write_text("IMPORTED = True\ndef make():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("widget", lazy={"lazy": "lazy_widget_module:make"})
    assert "lazy" in registry and registry.names() == ["lazy"]
    assert "lazy_widget_module" not in sys.modules  # names() and `in` import nothing
    assert registry.get("lazy")() == 42
    assert "lazy_widget_module" in sys.modules
    with pytest.raises(ValueError, match="must read 'package.module:Attr'"):
        registry.register_lazy("bad", "no_colon_here")


def test_a_lazy_module_may_register_its_own_entry(tmp_path, monkeypatch):
    registry = Registry("widget", lazy={"self": "self_registering_widget:Registered"})
    monkeypatch.setitem(sys.modules, "widget_registry_under_test", type(sys)("widget_registry_under_test"))
    sys.modules["widget_registry_under_test"].REGISTRY = registry
    (tmp_path / "self_registering_widget.py").write_text(
        "from widget_registry_under_test import REGISTRY\n"
        "@REGISTRY.register('self')\nclass Registered: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.get("self") is sys.modules["self_registering_widget"].Registered


def test_mapping_protocol_replaces_and_deletes():
    registry = Registry("widget", lazy={"later": "json:dumps"})
    registry["x"] = 1
    registry["x"] = 2  # item assignment replaces (monkeypatch.setitem, YAML loaders)
    assert dict(registry.items()) == {"x": 2, "later": __import__("json").dumps}
    del registry["later"]
    assert registry.names() == ["x"]
    assert registry.pop("x") == 2 and registry.pop("x", None) is None
    with pytest.raises(KeyError, match="unknown widget 'x'"):
        del registry["x"]


def test_a_name_held_by_a_lazy_entry_is_taken():
    registry = Registry("widget", lazy={"dumps": "json:dumps"})
    with pytest.raises(ValueError, match=r"widget 'dumps' is already registered \(by json.dumps\); pick another"):
        registry.register("dumps", print)
    import json

    registry.register("dumps", json.dumps)  # the lazy entry's own object (a module registering itself) is fine
    assert registry.get("dumps") is json.dumps

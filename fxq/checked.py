"""Checked settings dataclasses: every field is type- and range-checked when it is set, unknown names raise.

The machinery behind :class:`fxq.QuantizationSetting` and every algorithm's own settings dataclass
(``@checked_setting("setting.adaround_setting")``). A field's checks live in its ``opt(...)`` metadata; a setting
may also compose fields it does not declare (:meth:`Checked.extra_fields`), as ``QuantizationSetting`` does with
the registered algorithms' switches and settings.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
import warnings
from typing import Any, Callable, ClassVar, Union

from fxq.errors import ConfigError
from fxq.registry import Registry, close_names

__all__ = ["Checked", "ExtraField", "checked_setting", "check_value", "opt", "LEARNING_RATE", "OPTIMIZATION_STEPS"]

OPTIMIZATION_STEPS = {"ge": 1, "why": "a number of optimization steps"}
"""Rules of a ``steps`` field: ``opt(500, **OPTIMIZATION_STEPS)``."""
LEARNING_RATE = {"gt": 0.0, "why": "a learning rate"}
"""Rules of an ``lr`` field."""


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# ------------------------------------------------------------------------------------------- field checks
def opt(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **rules: Any) -> Any:
    """A dataclass field with checking rules in its metadata: ``gt``, ``ge``, ``le``, ``lt``, ``choices``,
    ``registry`` (a :class:`~fxq.registry.Registry` the value, or each value of a list, must be registered in),
    ``device`` (a torch device string), ``check`` (a callable ``(value, path) -> value``), ``why`` (said when a
    bound is broken)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


@dataclasses.dataclass(frozen=True)
class ExtraField:
    """A field a setting composes from elsewhere (a registry) instead of declaring it: its type, default and rules."""

    type: Any
    default: Callable[[], Any]
    metadata: typing.Mapping[str, Any] = dataclasses.field(default_factory=dict)


def check_value(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked (and normalized: list -> tuple, int -> float, dict -> sub-setting) against ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        return check_value(value, arms[0], path)
    if tp is bool:
        if not isinstance(value, bool):
            hint = " (a JSON true/false, not a string)" if isinstance(value, str) else ""
            raise ConfigError(f"{path} must be true or false{hint}, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {_kind(value)}")
        return value
    if origin is list:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {_kind(value)}")
        return [check_value(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path} must be a list of {len(args)} values, got {_kind(value)}")
        return tuple(check_value(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (frozenset, set):
        if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
            raise ConfigError(f"{path} must be a set of values, got {_kind(value)}")
        return frozenset(check_value(v, args[0], f"{path} item") for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a dict, got {_kind(value)}")
        return {check_value(k, args[0], f"{path} key"): check_value(v, args[1], f"{path}[{k!r}]")
                for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Checked):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return tp.from_dict(value)
        raise ConfigError(f"{path} must be a dict of {tp.__name__} fields ({', '.join(tp.field_names())}) or a "
                          f"{tp.__name__}, got {_kind(value)}")
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{path} must be a {tp.__name__}, got {_kind(value)}")
        return value
    raise AssertionError(f"no check for {tp!r}")


def _check_rules(value: Any, rules: typing.Mapping[str, Any], path: str) -> Any:
    for op, bound, what in (("gt", rules.get("gt"), ">"), ("ge", rules.get("ge"), ">="),
                            ("lt", rules.get("lt"), "<"), ("le", rules.get("le"), "<=")):
        if bound is None or value is None:
            continue
        ok = {"gt": value > bound, "ge": value >= bound, "lt": value < bound, "le": value <= bound}[op]
        if not ok:
            raise ConfigError(f"{path}={value!r} must be {what} {bound}" + (f" ({rules['why']})" if "why" in rules
                                                                               else ""))
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"{path}={value!r}; use one of {list(rules['choices'])}")
    names = value if isinstance(value, list) else [] if value is None else [value]
    reg: Registry[Any] | None = rules.get("registry")
    for name in names if reg is not None else ():
        if name not in reg:
            raise ConfigError(f"{reg.unknown(name, path)}. Register yours with fxq.register_{reg.kind}({name!r}) "
                              f"before building the setting")
    if rules.get("device"):
        import torch  # noqa: PLC0415

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ConfigError(f"{path}={value!r} is not a torch device; use 'cpu' or 'cuda'") from None
    if rules.get("check"):
        value = rules["check"](value, path)
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_EXTRA = "_checked_extra"
"""Instance attribute holding the values of a setting's extra (composed) fields."""


class Checked:
    """Base of the settings dataclasses: every field is type- and range-checked when set; unknown names raise.

    Class attributes: ``PATH`` (how messages name the object, e.g. ``setting.lsq_optimization_setting``),
    ``ALIASES`` (accepted spellings -> field) and ``REMOVED`` (removed field -> what fxq does instead).
    Override :meth:`extra_fields` to compose fields that live elsewhere; they behave like declared ones.
    """

    PATH: ClassVar[str] = "setting"
    ALIASES: ClassVar[dict[str, str]] = {}
    REMOVED: ClassVar[dict[str, str]] = {}
    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    @classmethod
    def extra_fields(cls) -> dict[str, ExtraField]:
        """Fields this setting has besides its declared ones (none by default), in order."""
        return {}

    @classmethod
    def field_names(cls) -> list[str]:
        return [*(f.name for f in dataclasses.fields(cls)), *cls.extra_fields()]

    @classmethod
    def _field_rule(cls, name: str) -> tuple[Any, typing.Mapping[str, Any]] | None:
        """``(type, rules)`` of field ``name``, or None if there is no such field."""
        declared = {f.name: f for f in dataclasses.fields(cls)}
        if name in declared:
            return _hints(cls)[name], declared[name].metadata
        extra = cls.extra_fields().get(name)
        return None if extra is None else (extra.type, extra.metadata)

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        rule = cls._field_rule(name)
        if rule is not None:
            path = f"{cls.PATH}.{name}"
            value = _check_rules(check_value(value, rule[0], path), rule[1], path)
            if name in cls.extra_fields():
                self.__dict__.setdefault(_EXTRA, {})[name] = value
                return
        elif isinstance(getattr(cls, name, None), property):
            pass  # e.g. LSQSetting.epochs, whose setter assigns a field
        elif name in cls.REMOVED:
            _removed(cls, name, value)
            return
        else:
            raise ConfigError(_unknown(cls, name))
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """An extra field's value (its default until set); called only when normal lookup fails."""
        extra = type(self).extra_fields().get(name) if not name.startswith("__") else None
        if extra is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        values = self.__dict__.setdefault(_EXTRA, {})
        if name not in values:
            values[name] = extra.default()
        return values[name]

    @classmethod
    def _known_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Constructor keywords with aliases resolved, removed fields handled, unknown ones refused."""
        fields = cls.field_names()
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in cls.REMOVED:
                _removed(cls, key, value)
                continue
            key = cls.ALIASES.get(key, key)
            if key not in fields:
                raise ConfigError(_unknown(cls, key))
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Build from a (json) dict; unknown keys raise with the closest names."""
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.PATH} must be a dict of {cls.__name__} fields, got {_kind(data)}")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{cls.PATH}: field names are strings, got {_kind(bad[0])}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Every field, sub-settings as dicts (what ``json.dumps`` and :meth:`from_dict` take)."""
        return {name: _plain(getattr(self, name)) for name in self.field_names()}

    def validate(self) -> Any:
        """Re-check every field (lists / dicts may have changed in place); returns self."""
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, Checked):
                value.validate()
            setattr(self, name, value)
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self.field_names())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.field_names())})"


def _plain(value: Any) -> Any:
    """``dataclasses.asdict``'s conversion of one field value, extra fields included."""
    if isinstance(value, Checked):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _unknown(cls: type[Checked], name: str) -> str:
    fields = cls.field_names()
    near = close_names(name, [*fields, *cls.ALIASES])
    msg = f"{cls.PATH}: unknown field {name!r}{near}; fields: {', '.join(fields)}"
    scheme = close_names(name, ("bit_width", "symmetrical", "per_channel"))
    if scheme:
        msg += (f". Bit width / symmetry / per-channel are not settings: pass them to fxq.quantize / fxq.prepare "
                f"(bit_width=4) or per layer in setting.dispatching_table ({{'fc': {{'bit_width': 4}}}}){scheme}")
    return msg


def _removed(cls: type[Checked], name: str, value: Any) -> None:
    path = f"{cls.PATH}.{name}"
    if value is True:
        warnings.warn(f"{path} was removed and is ignored: {cls.REMOVED[name]}; drop the key",
                      DeprecationWarning, stacklevel=4)
        return
    raise ConfigError(f"{path}={value!r}: this field was removed ({cls.REMOVED[name]}) and cannot be switched off; "
                      f"drop the key")


def checked_setting(path: str) -> Callable[[type], type]:
    """``@dataclass`` plus a constructor that resolves aliases and names unknown keywords in a ConfigError.

    ``path`` is how messages name the object (``"setting.adaround_setting"``).
    """

    def deco(cls: type) -> type:
        cls.PATH = path
        cls = dataclasses.dataclass(cls, eq=False, repr=False)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            fields = dataclasses.fields(cls)
            if len(args) > len(fields):
                raise ConfigError(f"{path} takes at most {len(fields)} positional values, got {len(args)}")
            known = cls._known_kwargs(kwargs)
            declared = {f.name for f in dataclasses.fields(cls)}
            init(self, *args, **{k: v for k, v in known.items() if k in declared})
            for key, value in known.items():
                if key not in declared:
                    setattr(self, key, value)

        cls.__init__ = __init__
        return cls

    return deco

"""Frozen value records for vramcalc's core types, validated by pydantic at the boundary.

The estimate path must start in well under 0.3 s (issue 2) and builds thousands of these
objects per second in the planner. Importing pydantic alone takes ~0.16 s on the 2-core
reference machine, more than half of that budget. So the core types (ModelSpec,
TrainingConfig, ParallelConfig, GPUProfile, Cluster, Scenario and the report) are
`Record`s: plain frozen classes that declare their fields with annotations, defaults and
`field(...)` constraints, in the style of a pydantic model.

Three ways to build one:

- `Cls(**values)` validates through a pydantic model derived from the declarations (built
  on first use; pydantic is imported then): types are checked and coerced, Literal choices
  and bounds enforced, unknown names rejected (`extra="forbid"`), then the class's own
  `_check()` runs. Files, user input and library callers come in this way.
- `Cls.model_construct(**values)` trusts its values (data the validator already passed,
  read back from the parse cache in vramcalc/yamlio.py, or ints the engine computed).
- `obj.model_copy(update=...)` copies with changes, unvalidated (as in pydantic).

The CLI's option values are coerced and choice-checked by vramcalc/options.py, which
checks the numeric bounds declared here with `bound_violation` (pydantic's wording), so a
run that hits the parse cache never imports pydantic (tests/test_cli.py checks it).
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar

_REQUIRED: Any = object()
_CONSTRAINTS = ("gt", "ge", "lt", "le", "pattern", "min_length")


class FieldInfo:
    """One declared field: its default (or required) and its constraints."""

    __slots__ = ("name", "default", "constraints")

    def __init__(self, name: str, default: Any, constraints: dict[str, Any]) -> None:
        self.name, self.default, self.constraints = name, default, constraints

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


class _Declared:
    """What `field(...)` returns inside a class body; replaced at class creation."""

    __slots__ = ("default", "constraints")

    def __init__(self, default: Any, constraints: dict[str, Any]) -> None:
        self.default, self.constraints = default, constraints


def field(default: Any = _REQUIRED, **constraints: Any) -> Any:
    """A field's default and constraints: gt, ge, lt, le (numbers), pattern, min_length."""
    unknown = set(constraints) - set(_CONSTRAINTS)
    if unknown:
        raise TypeError(f"unknown field constraints: {', '.join(sorted(unknown))}")
    return _Declared(default, constraints)


class Record:
    """Base of the frozen records; see the module docstring."""

    model_fields: ClassVar[dict[str, FieldInfo]] = {}
    _names: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _mutable: ClassVar[tuple[str, ...]] = ()
    _tuples: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, validate: bool = True, **kwargs: Any) -> None:
        """`validate=False`: an internal record whose constructor trusts its values (the
        engine builds it from numbers it computed); names are still checked."""
        super().__init_subclass__(**kwargs)
        if not validate:
            cls.__init__ = _trusted_init  # type: ignore[method-assign]
        fields = dict(cls.model_fields)  # inherited declarations first
        for name, ann in cls.__dict__.get("__annotations__", {}).items():
            if str(ann).startswith(("ClassVar", "typing.ClassVar")):
                continue
            value = cls.__dict__.get(name, _REQUIRED)
            constraints: dict[str, Any] = {}
            if isinstance(value, _Declared):
                value, constraints = value.default, value.constraints
                if value is _REQUIRED:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value)
            fields[name] = FieldInfo(name, value, constraints)
            if str(ann).startswith("tuple["):
                cls._tuples = (*cls._tuples, name)
        cls.model_fields = fields
        cls._names = tuple(fields)
        cls._defaults = {n: f.default for n, f in fields.items() if not f.required}
        cls._mutable = tuple(n for n, v in cls._defaults.items()
                             if isinstance(v, (list, dict, set)))

    # ---- construction ---------------------------------------------------------------
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(_validated(type(self), values))
        self._check()

    @classmethod
    def pydantic_model(cls) -> Any:
        """The pydantic model that validates this record's fields (for JSON schema, say)."""
        return schema(cls)[0]

    @classmethod
    def model_validate(cls, data: dict[str, Any]) -> Any:
        """`cls(**data)`: a validated record from a mapping (pydantic's spelling)."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        return cls(**data)

    @classmethod
    def model_construct(cls, **values: Any) -> Any:
        """A record from trusted values (defaults filled in, nothing checked)."""
        obj = cls.__new__(cls)
        obj._fill(values)
        return obj

    def _fill(self, values: dict[str, Any]) -> None:
        """Set the fields: the defaults (mutable ones copied), then `values`."""
        d = self.__dict__
        d.update(self._defaults)
        for name in self._mutable:
            d[name] = d[name].copy()
        d.update(values)

    @classmethod
    def from_dump(cls, data: dict[str, Any]) -> Any:
        """Rebuild a flat record from its own `model_dump(mode="json")` (trusted: e.g. read
        back from the validated-file cache, vramcalc/yamlio.py); lists become tuples again
        where the field is a tuple."""
        for name in cls._tuples:
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        return cls.model_construct(**data)

    def model_copy(self, *, update: dict[str, Any] | None = None) -> Any:
        """A copy with `update` applied (not validated, as pydantic's model_copy)."""
        cls = type(self)
        obj = cls.__new__(cls)
        d = self.__dict__
        obj.__dict__.update({n: d[n] for n in cls._names})
        if update:
            unknown = set(update) - set(cls._names)
            if unknown:
                raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
            obj.__dict__.update(update)
        return obj

    @classmethod
    def _prepare(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Normalise raw values before validation (a class may override)."""
        return values

    def _check(self) -> None:
        """Cross-field checks after validation; raise InputError/ValueError (override)."""

    # ---- value semantics ------------------------------------------------------------
    def _values(self) -> tuple[Any, ...]:
        d = self.__dict__
        return tuple(d[n] for n in self._names)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        d = self.__dict__
        h = d.get("_record_hash")
        if h is None:
            h = d["_record_hash"] = hash((type(self).__name__, self._values()))
        return h

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # the cached hash depends on this process's string-hash seed: never pickle it
        return {k: v for k, v in self.__dict__.items() if k != "_record_hash"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        d = self.__dict__
        inner = ", ".join(f"{n}={d[n]!r}" for n in self._names if n in d)
        return f"{type(self).__name__}({inner})"

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """Fields as a dict, nested records too; mode="json" turns tuples into lists."""
        d = self.__dict__
        as_json = mode == "json"
        return {n: _dump(d[n], as_json) for n in self._names}


def _trusted_init(self: Record, **values: Any) -> None:
    cls = type(self)
    missing = [n for n in cls._names if n not in values and n not in cls._defaults]
    unknown = [n for n in values if n not in cls.model_fields]
    if missing or unknown:
        raise TypeError(f"{cls.__name__}: missing {missing or 'nothing'}, unknown "
                        f"{unknown or 'nothing'}")
    self._fill(values)


def _dump(value: Any, as_json: bool) -> Any:
    if isinstance(value, Record):
        return value.model_dump("json" if as_json else "python")
    if isinstance(value, dict):
        return {k: _dump(v, as_json) for k, v in value.items()}
    if isinstance(value, list):
        return [_dump(v, as_json) for v in value]
    if isinstance(value, tuple):
        items = [_dump(v, as_json) for v in value]
        return items if as_json else tuple(items)
    return value


def bound_violation(info: FieldInfo, value: Any) -> str | None:
    """The declared numeric bound `value` breaks, in pydantic's words; None when it is in
    range (or None). Used where values were coerced already (vramcalc/options.py)."""
    if value is None or isinstance(value, bool):
        return None
    c = info.constraints
    if "gt" in c and not value > c["gt"]:
        return f"Input should be greater than {c['gt']}"
    if "ge" in c and not value >= c["ge"]:
        return f"Input should be greater than or equal to {c['ge']}"
    if "lt" in c and not value < c["lt"]:
        return f"Input should be less than {c['lt']}"
    if "le" in c and not value <= c["le"]:
        return f"Input should be less than or equal to {c['le']}"
    return None


def first_bound_violation(cls: type[Record], values: dict[str, Any]
                          ) -> tuple[str, str] | None:
    """(field, problem) for the first of `values` out of `cls`'s declared bounds, or None."""
    for name, value in values.items():
        problem = bound_violation(cls.model_fields[name], value)
        if problem:
            return name, problem
    return None


# ---- validation through pydantic (imported here only) ---------------------------------
_SCHEMAS: dict[type, tuple[Any, dict[str, type[Record]]]] = {}


def _record_type(tp: Any) -> tuple[type[Record] | None, str]:
    """(Record class, how it is held: "one" or "many") when a field holds records."""
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp, "one"
    args = typing.get_args(tp)
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, Record):
            origin = typing.get_origin(tp)
            return arg, "many" if origin in (list, tuple) else "one"
    return None, ""


def schema(cls: type[Record]) -> tuple[Any, dict[str, tuple[type[Record], str]]]:
    """The pydantic model validating `cls`'s fields (built once). Fields holding records
    are passed through pydantic as Any and built (or checked) by `_validated`."""
    cached = _SCHEMAS.get(cls)
    if cached is not None:
        return cached
    import pydantic

    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    nested: dict[str, tuple[type[Record], str]] = {}
    for name, info in cls.model_fields.items():
        tp = hints[name]
        rec, how = _record_type(tp)
        if rec is not None:
            nested[name] = (rec, how)
            tp = Any
        default = ... if info.required else info.default
        fields[name] = (tp, pydantic.Field(default, **info.constraints))
    model = pydantic.create_model(  # type: ignore[call-overload]
        cls.__name__,
        __config__=pydantic.ConfigDict(extra="forbid", protected_namespaces=()),
        **fields,
    )
    _SCHEMAS[cls] = (model, nested)
    return model, nested


def _validated(cls: type[Record], values: dict[str, Any]) -> dict[str, Any]:
    """Field values of `cls` from untrusted `values` (raises pydantic's ValidationError)."""
    model, nested = schema(cls)
    checked = model.model_validate(cls._prepare(dict(values)))
    out = {n: getattr(checked, n) for n in cls._names}
    for name, (rec, how) in nested.items():
        value = out[name]
        if how == "many" and isinstance(value, (list, tuple)):
            out[name] = type(value)(_as_record(rec, v, name) for v in value)
        elif value is not None:
            out[name] = _as_record(rec, value, name)
    return out


def _as_record(rec: type[Record], value: Any, name: str) -> Record:
    if isinstance(value, rec):
        return value
    if isinstance(value, dict):
        return rec(**value)
    raise ValueError(f"{name}: expected a {rec.__name__}, got {type(value).__name__}")

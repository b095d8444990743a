"""Settings declared once: a configuration field carries its default, bounds, choices, command-line
flag and help (:func:`setting`), and the generic checks read them.

=========================  ======================================================================
:func:`check_number`       a finite number (an integer by default) of at least a minimum
:func:`check_positive`     a finite number greater than 0
:func:`check_choice`       one of the allowed values
:func:`setting`            a dataclass field with its bounds, flag and help in ``metadata``
:func:`check_settings`     every declared bound of a configuration object, by its fields
:func:`changed_flags`      the flags of fields set away from their defaults
:func:`comma_list`         a comma-separated option's items
:func:`build`              a configuration from named option values (the command line's)
:class:`Opt`, :func:`opt`  how a setting appears on the command line (typer-free)
:func:`config_opts`        the options a configuration's fields declare
:class:`Settings`          base of configuration dataclasses: ``validate()``, ``to_dict()``
:class:`Checked`           a :class:`Settings` validated on construction (``__post_init__``)
=========================  ======================================================================

Every failed check is an :class:`~depthscope.common.errors.InputError` that names the setting.
The command line (``analyses/commands/options.py``) turns the :class:`Opt` s of the same
metadata into typer options, so an option's flag, default, range and help are written once,
beside the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from depthscope.common.errors import InputError

#: metadata keys :func:`setting` fills (read by the checks and by the command-line generator)
KEYS = ("flags", "help", "min", "max", "positive", "choices", "param", "parse", "show", "cli_type", "cli_min")


def check_number(name: str, value, *, minimum: float = 1, integer: bool = True, allow_none: bool = False) -> None:
    """The one numeric check of every configuration: ``value`` is a finite number (an integer when
    ``integer``) of at least ``minimum`` (``minimum=0.0`` with ``integer=False``: greater than 0),
    or None when ``allow_none``; else an :class:`~depthscope.common.errors.InputError` naming it."""
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = value >= minimum
    elif ok:
        ok = value > 0 if minimum == 0.0 else value >= minimum
    if not ok:
        what = "an integer" if integer else "a finite number"
        bound = f">= {minimum}" if integer or minimum != 0.0 else "> 0"
        raise InputError(f"{name} must be {what} {bound}, got {value!r}")


def check_positive(name: str, value, *, allow_none: bool = False) -> None:
    """``value`` is a finite number greater than 0 (or None when ``allow_none``)."""
    check_number(name, value, minimum=0.0, integer=False, allow_none=allow_none)


def check_choice(name: str, value, allowed) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise InputError(f"{name} must be one of {allowed}, got {value!r}")


def setting(default=dataclasses.MISSING, *flags: str, factory=dataclasses.MISSING, **meta) -> dataclasses.Field:
    """A dataclass field whose ``metadata`` declares the setting: ``flags`` (the command-line
    option's names, e.g. ``"--max-epochs"`` or ``"--mdl/--no-mdl"``; none: not an option),
    ``help``; the checks ``min`` (an integer of at least this), ``positive`` (a finite number
    > 0), ``choices``, ``max`` (the option's upper bound); and for the command line ``param``
    (its parameter name, default the field's), ``cli_min`` (the option's lower bound when not ``min``),
    ``parse`` (option value -> field value), ``show``
    (field default -> option default) and ``cli_type`` (the option's type when not the field's)."""
    unknown = set(meta) - set(KEYS)
    if unknown:
        raise TypeError(f"unknown setting metadata {sorted(unknown)}")
    metadata = {**meta, "flags": flags} if flags else meta
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def _optional(f: dataclasses.Field) -> bool:
    """True when the field's annotation admits None."""
    return "None" in str(f.type)


def check_settings(obj) -> None:
    """Check every field of ``obj`` against the bounds its :func:`setting` declares; None passes
    where the annotation admits it."""
    for f in dataclasses.fields(obj):
        meta, value = f.metadata, getattr(obj, f.name)
        if "choices" in meta and not (value is None and _optional(f)):
            check_choice(f.name, value, meta["choices"])
        if "min" in meta:
            check_number(f.name, value, minimum=meta["min"], allow_none=_optional(f))
        if meta.get("positive"):
            check_positive(f.name, value, allow_none=_optional(f))


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def changed_flags(obj, names) -> list[str]:
    """The flags of the fields ``names`` of ``obj`` whose values differ from their defaults (a held
    configuration: each of its fields); for refusing settings that would be silently ignored."""
    flags = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name not in names:
            continue
        if isinstance(value, Settings):
            flags += changed_flags(value, [g.name for g in dataclasses.fields(value)])
        elif f.metadata.get("flags") and _plain(value) != _plain(_default(f)):
            flags.append(f.metadata["flags"][0].split("/")[0])
    return flags


def _plain(value):
    """Lists and tuples compare as lists."""
    return list(value) if isinstance(value, (list, tuple)) else value


def held(f: dataclasses.Field):
    """The configuration class a field holds (its default factory), else None."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def build(cls, values, **fixed):
    """``cls`` from named option ``values`` (a mapping or namespace, by each setting's ``param``
    name): each field with a flag takes its value (through the field's ``parse``), a held
    configuration is built the same way, ``fixed`` sets the rest. The object is validated once: a
    :class:`Checked` class on construction, another :class:`Settings` here."""
    values = values if isinstance(values, dict) else vars(values)
    kw = dict(fixed)
    for f in dataclasses.fields(cls):
        meta, param = f.metadata, f.metadata.get("param", f.name)
        if f.name in kw:
            continue
        if meta.get("flags") and param in values:
            kw[f.name] = meta["parse"](values[param]) if "parse" in meta else values[param]
        elif held(f) is not None:
            kw[f.name] = build(held(f), values)
    obj = cls(**kw)
    return obj.validate() if isinstance(obj, Settings) and not isinstance(obj, Checked) else obj


@dataclass(frozen=True)
class Opt:
    """How a setting appears on the command line: its name (the parsed value's key), type,
    default, flags and help; ``min``/``max``: its range; ``positive``: a float > 0;
    ``argument``: a positional argument (``metavar`` names it)."""

    name: str
    annotation: object
    default: object
    flags: tuple[str, ...] = ()
    help: str = ""
    min: float | None = None
    max: float | None = None
    positive: bool = False
    argument: bool = False
    metavar: str | None = None

    def but(self, **changes) -> Opt:
        """This option with some attributes changed (another default or help)."""
        return dataclasses.replace(self, **changes)


def opt(flags: str, default, help: str, type=None, **kw) -> Opt:
    """An option that is no configuration's field: ``flags`` space-separated (``"--out -o"``), its
    name the first flag's (``out``), its type ``type`` or the default's."""
    first = flags.split()[0].lstrip("-").split("/")[0]
    kind = type or (Path if isinstance(default, Path) else default.__class__)
    return Opt(first.replace("-", "_"), kind, default, tuple(flags.split()), help, **kw)


def _field_opt(f: dataclasses.Field, hint) -> Opt:
    """The option a configuration field declares (its default shown as the option's default)."""
    meta = f.metadata
    default = _default(f)
    return Opt(
        name=meta.get("param", f.name),
        annotation=meta.get("cli_type", hint),
        default=meta["show"](default) if "show" in meta else default,
        flags=meta["flags"],
        help=meta.get("help", ""),
        min=meta.get("cli_min", meta.get("min")),
        max=meta.get("max"),
        positive=bool(meta.get("positive")),
    )


def config_opts(cls) -> dict[str, Opt]:
    """Every option the fields of ``cls`` (and of the configurations it holds) declare, by name."""
    hints = typing.get_type_hints(cls)
    found: dict[str, Opt] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flags"):
            opt = _field_opt(f, hints[f.name])
            found[opt.name] = opt
        elif held(f) is not None:
            found.update(config_opts(held(f)))
    return found


class Settings:
    """Base of the configuration dataclasses: :meth:`validate` checks the declared bounds and the
    class's own rules (:meth:`check`); :meth:`to_dict` is the JSON-able record of a run."""

    def check(self) -> None:
        """Rules beyond one field's bounds (a subclass's own); raise InputError."""

    def validate(self):
        """Check the settings; returns self."""
        check_settings(self)
        self.check()
        return self

    def to_dict(self) -> dict:
        """The fields as plain JSON values (paths as strings, nested configurations as dicts)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


class Checked(Settings):
    """A :class:`Settings` checked on construction: an invalid object is never built."""

    def __post_init__(self) -> None:
        self.validate()


def comma_list(text: str | None) -> list[str] | None:
    """A comma-separated option as a list of its non-blank items (None for none)."""
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    return items or None

"""Settings declared once: a configuration field carries its default, bounds, choices, command-line
flag and help (:func:`setting`), and the generic checks read them.

=============================  ==================================================================
:func:`check_number`           a finite number (an integer by default) of at least a minimum and
                               at most a maximum (int64's largest for integers where none is given)
:func:`check_positive`         a finite number greater than 0 (and at most a maximum)
:class:`Limit`                 an upper bound and why; a number or one the machine sets
:data:`SEED`, :data:`CPUS`     seeds (0 .. 2**32-1); CPU threads and workers (4 x the CPUs)
:data:`BATCH`, :data:`TOKENS`  sequences and tokens per forward pass
:func:`cpu_count`              the CPUs this process may run on
:func:`memory_bytes`           this machine's available (or total) memory: psutil, else /proc/meminfo
:func:`check_bounds`           one value against the bounds one :func:`setting` declares
:func:`check_choice`           one of the allowed values
:func:`setting`                a dataclass field with its bounds, flag and help in ``metadata``
:func:`check_settings`         every declared bound of a configuration object, by its fields
:func:`changed_flags`          the flags of fields set away from their defaults
:func:`comma_list`             a comma-separated option's items
:func:`build`                  a configuration from named option values (the command line's)
:class:`Opt`, :func:`opt`      how a setting appears on the command line (typer-free)
:func:`config_opts`            the options a configuration's fields declare
:class:`Settings`              base of configuration dataclasses: ``validate()``, ``to_dict()``
:class:`Checked`               a :class:`Settings` validated on construction (``__post_init__``)
=============================  ==================================================================

Every failed check is an :class:`~depthscope.common.errors.InputError` that names the setting, and an
upper bound's message says where the bound comes from (:class:`Limit`). Every numeric setting has
an upper bound: its declared ``max``, else the largest int64 (integers) or float (floats), so no
value allocates, loops or overflows without bound.
The command line (``analyses/commands/options.py``) turns the :class:`Opt` s of the same
metadata into typer options, so an option's flag, default, range and help are written once,
beside the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from depthscope.common.errors import InputError

#: metadata keys :func:`setting` fills (read by the checks and by the command-line generator)
KEYS = (
    "flags",
    "help",
    "min",
    "max",
    "positive",
    "choices",
    "check",
    "param",
    "parse",
    "show",
    "cli_type",
    "cli_min",
)
#: the largest integer a setting takes where it declares no bound (what torch and numpy hold)
INT_MAX = 2**63 - 1


@dataclass(frozen=True)
class Limit:
    """An upper bound and why: ``value`` a number, or a function of nothing for a bound the machine
    sets (read when checked); ``why`` a text, or a function of nothing, for the message."""

    value: float | Callable[[], float]
    why: str | Callable[[], str] = ""

    def get(self) -> float:
        """The bound now."""
        return self.value() if callable(self.value) else self.value

    def reason(self) -> str:
        """Why the bound is what it is (empty: no reason given)."""
        return self.why() if callable(self.why) else self.why


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity where the system says, else all)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def memory_bytes(kind: str = "available") -> int | None:
    """This machine's ``available`` (or ``total``) memory in bytes: psutil where installed, else
    ``/proc/meminfo``; None where neither says."""
    try:
        import psutil  # lazy: optional

        vm = psutil.virtual_memory()
        return int(vm.available if kind == "available" else vm.total)
    except ImportError:
        pass
    key = "MemAvailable:" if kind == "available" else "MemTotal:"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: threads and CPU workers: more than a few per CPU only adds synchronisation and memory (each
#: thread's buffers; torch segfaults or allocates gigabytes at absurd counts)
CPU_FACTOR = 4
CPUS = Limit(lambda: CPU_FACTOR * cpu_count(), lambda: f"{CPU_FACTOR} x the {cpu_count()} CPUs of this machine")
#: seeds: the range every generator it feeds takes (numpy's legacy seeds, torch's manual_seed)
SEED = Limit(2**32 - 1, "the seed range of numpy and torch generators, 0 .. 2**32-1")
#: a forward pass: sequences per batch, and tokens per batch or per passage (a million tokens of
#: activations already take gigabytes; larger batches cost memory and gain no speed)
BATCH = Limit(4096, "sequences per forward pass; larger batches only take more memory")
TOKENS = Limit(2**20, "tokens per forward pass or passage; a million already take gigabytes of activations")


def check_number(
    name: str,
    value,
    *,
    minimum: float = 1,
    maximum: float | Limit | None = None,
    integer: bool = True,
    allow_none: bool = False,
) -> None:
    """The one numeric check of every configuration: ``value`` is a finite number (an integer when
    ``integer``) of at least ``minimum`` (``minimum=0.0`` with ``integer=False``: greater than 0)
    and at most ``maximum`` (a number or a :class:`Limit`; None: :data:`INT_MAX` for integers, the
    largest float otherwise), or None when ``allow_none``; else an
    :class:`~depthscope.common.errors.InputError` naming it (and, past the maximum, the bound and why).
    Integers of any size, floats past the float range, NaN and infinities are all refused, none raises."""
    if value is None and allow_none:
        return
    what = "an integer" if integer else "a finite number"
    bound = "" if minimum == -math.inf else f" >= {minimum}" if integer or minimum != 0.0 else " > 0"
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool) or not _finite(value):
        raise InputError(f"{name} must be {what}{bound}, got {value!r}")
    if not (value > 0 if (not integer and minimum == 0.0) else value >= minimum):
        raise InputError(f"{name} must be {what}{bound}, got {value!r}")
    limit = maximum if isinstance(maximum, Limit) else Limit(INT_MAX if integer else sys.float_info.max)
    if isinstance(maximum, (int, float)):
        limit = Limit(maximum)
    top = limit.get()
    if value > top:
        why = f" ({limit.reason()})" if limit.reason() else ""
        raise InputError(f"{name} must be at most {_show(top)}{why}, got {_show(value)}")


def _finite(value) -> bool:
    """A real number that is finite (any integer is; a float or numpy number tested as a float)."""
    if isinstance(value, numbers.Integral):
        return True
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError, ValueError):
        return False


def _show(value) -> str:
    """A bound or value for a message: integers whole (up to 20 digits, else their digits
    counted), other numbers in %g."""
    if isinstance(value, numbers.Integral):
        digits = len(str(abs(int(value))))
        return str(int(value)) if digits <= 20 else f"an integer of {digits} digits"
    return f"{float(value):g}"


def check_positive(name: str, value, *, maximum: float | Limit | None = None, allow_none: bool = False) -> None:
    """``value`` is a finite number greater than 0 and at most ``maximum`` (or None when ``allow_none``)."""
    check_number(name, value, minimum=0.0, maximum=maximum, integer=False, allow_none=allow_none)


def check_choice(name: str, value, allowed) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise InputError(f"{name} must be one of {allowed}, got {value!r}")


def setting(default=dataclasses.MISSING, *flags: str, factory=dataclasses.MISSING, **meta) -> dataclasses.Field:
    """A dataclass field whose ``metadata`` declares the setting: ``flags`` (the command-line
    option's names, e.g. ``"--max-epochs"`` or ``"--mdl/--no-mdl"``; none: not an option),
    ``help``; the checks ``min`` (an integer of at least this), ``positive`` (a finite number
    > 0), ``choices``, ``max`` (the upper bound: a number or a :class:`Limit` that says why),
    ``check`` (a function ``(name, value)`` raising InputError: the setting's own rule); the
    command line checks the same (:func:`check_bounds`); and for the command line ``param``
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


def check_bounds(name: str, value, meta, *, optional: bool = False) -> None:
    """``value`` against the bounds the metadata ``meta`` of one :func:`setting` declares
    (``choices``; ``min``: an integer of at least it; ``positive``: a finite number > 0; ``max``:
    the upper bound, a number or :class:`Limit`, with ``min``/``positive`` or alone for a float;
    ``check``: a function ``(name, value)`` of the setting's own rule), named ``name`` in the
    messages; None passes where ``optional``. The command line checks the same bounds on the
    parsed option (``analyses/commands/options.py``)."""
    if value is None and optional:
        return
    if "choices" in meta:
        check_choice(name, value, meta["choices"])
    if meta.get("positive"):
        check_positive(name, value, maximum=meta.get("max"))
    elif "min" in meta:
        check_number(name, value, minimum=meta["min"], maximum=meta.get("max"))
    elif "max" in meta:
        check_number(name, value, minimum=-math.inf, maximum=meta["max"], integer=False)
    if "check" in meta:
        meta["check"](name, value)


def check_settings(obj) -> None:
    """Check every field of ``obj`` against the bounds its :func:`setting` declares
    (:func:`check_bounds`); None passes where the annotation admits it."""
    for f in dataclasses.fields(obj):
        check_bounds(f.name, getattr(obj, f.name), f.metadata, optional=_optional(f))


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
    default, flags and help; ``min``/``max``: its range (``max`` a number or a :class:`Limit`);
    ``positive``: a float > 0; ``check``: the setting's own rule (a function ``(name, value)``);
    ``argument``: a positional argument (``metavar`` names it)."""

    name: str
    annotation: object
    default: object
    flags: tuple[str, ...] = ()
    help: str = ""
    min: float | None = None
    max: float | Limit | None = None
    positive: bool = False
    check: Callable | None = None
    argument: bool = False
    metavar: str | None = None

    def but(self, **changes) -> Opt:
        """This option with some attributes changed (another default or help)."""
        return dataclasses.replace(self, **changes)

    @property
    def flag(self) -> str:
        """The option's long flag (``--max-epochs``; a switch's first), else its name."""
        return next((f for f in self.flags if f.startswith("--")), self.name).split("/")[0]

    @property
    def kind(self) -> type | None:
        """``int`` or ``float`` for a (possibly optional) numeric option, else None."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)] or [self.annotation]
        return args[0] if len(args) == 1 and args[0] in (int, float) else None

    def check_value(self, value):
        """A parsed numeric value checked as the configurations check it (:func:`check_number`,
        named by :attr:`flag`): finite, > 0 where ``positive``, at most ``max`` (none: int64's
        largest or the float range), and ``check``; the lower bound ``min`` is the command line's
        range, checked before. Returns ``value``."""
        if value is None:
            return value
        if self.positive:
            check_positive(self.flag, value, maximum=self.max)
        else:
            check_number(self.flag, value, minimum=-math.inf, maximum=self.max, integer=self.kind is int)
        if self.check is not None:
            self.check(self.flag, value)
        return value


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
        check=meta.get("check"),
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

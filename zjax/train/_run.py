"""A training run as configuration: sections of settings read from a TOML file and ``section.key=value`` overrides.

``zjax train run.toml plan.stage=3 optim.name=muon`` reads :class:`RunConfig` from the file (every key optional,
its default otherwise), then applies each override; ``zjax train --print-config`` writes the resolved settings as
TOML that the same command reads back. Paths in a file are relative to that file (the run works from any directory),
those on the command line to the working directory. A key that does not exist is refused with the closest one.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._config import LoopConfig
from ._optim import Optim

MESH_AXES = ("replica", "dp", "ep", "cp", "tp", "pp")


def mesh_sizes(text: str) -> dict[str, int]:
    """``"dp=4,tp=2"`` as ``{"dp": 4, "tp": 2}`` (``-1``: the devices left over, once)."""
    sizes: dict[str, int] = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, eq, value = part.partition("=")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if not eq or name not in MESH_AXES or name in sizes or size == 0 or size < -1:
            raise ValueError(
                f"plan.mesh = {text!r}: expected entries like dp=4,tp=2 or replica=2,dp=4 over the axes "
                f"{', '.join(MESH_AXES)} (a size, or -1 for the devices left over), got {part!r}."
            )
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"plan.mesh = {text!r}: -1 (the devices left over) may size one axis only.")
    return sizes


def _one_of(name: str, value: Any, options: Iterable[Any]) -> None:
    if value not in options:
        raise ValueError(f"{name} = {value!r}: use one of {', '.join(map(str, options))}.")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} = {value!r} must be >= {low}.")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """``[model]``: ``preset`` (tiny, small, medium, moe-small), ``seq_len`` (tokens per row), ``remat`` (a policy of
    ``zjax.remat.POLICIES``), ``matmul`` (the projections' products, ``zjax.fp8.MATMULS``), ``bf16_edge_layers``
    (that many first and last layers multiply in the compute dtype around fp8 ones), ``dropout`` (the probability
    of zeroing each attention and MLP output value in training, ``DecoderConfig.dropout``), ``hf`` (continue this
    Hugging Face checkpoint directory instead of a preset)."""

    preset: str = "small"
    seq_len: int = 128
    remat: str = "full"
    matmul: str = "default"
    bf16_edge_layers: int = 0
    dropout: float = 0.0
    hf: Path | None = None

    def __post_init__(self) -> None:
        from ..fp8 import MATMULS
        from ..models import PRESETS
        from ..remat import POLICIES

        _one_of("model.preset", self.preset, PRESETS)
        _one_of("model.remat", self.remat, POLICIES)
        _one_of("model.matmul", self.matmul, MATMULS)
        _at_least("model.seq_len", self.seq_len, 1)
        _at_least("model.bf16_edge_layers", self.bf16_edge_layers, 0)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.dropout = {self.dropout!r} must be in [0, 1) (0: no dropout).")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """``[data]``: ``path`` (text, .jsonl, .parquet or .npy files, or a directory; default: a few modules of Python's
    standard library), ``tokenizer`` (a tokenizer.json or its directory; default: bytes), ``batch_size`` (rows per
    step, global), ``eval_fraction`` (the share held out), ``seed`` (shuffling and the model's initialization)."""

    path: Path | None = None
    tokenizer: Path | None = None
    batch_size: int = 32
    eval_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least("data.batch_size", self.batch_size, 1)
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction = {self.eval_fraction!r} must be between 0 and 1.")


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """``[plan]``: the :class:`zjax.Plan`: ``stage`` (ZeRO 0-3), ``mesh`` (``"dp=4,tp=2"``; ``dp=-1``: every device),
    ``precision`` (fp32, bf16, fp16), ``accum`` (microbatches per step), ``offload`` (none, optimizer,
    optimizer+params), ``quantize_comm`` (ZeRO++: none, weights, grads, weights+grads), ``reduce_dtype`` (e.g.
    float32), ``compute_copy`` (stage 3: false keeps the fp32 weights only), ``hpz`` (ZeRO++'s hierarchical
    partitioning, with replica)."""

    stage: int = 3
    mesh: str = "dp=-1"
    precision: str = "bf16"
    accum: int = 1
    offload: str = "none"
    quantize_comm: str = "none"
    reduce_dtype: str | None = None
    compute_copy: bool = True
    hpz: bool = False

    def __post_init__(self) -> None:
        from ..comm import parse
        from ..core import PRECISIONS
        from ..offload import Offload

        _one_of("plan.stage", self.stage, (0, 1, 2, 3))
        _one_of("plan.precision", self.precision, PRECISIONS)
        _one_of("plan.offload", self.offload, Offload.NAMES)
        _at_least("plan.accum", self.accum, 1)
        mesh_sizes(self.mesh)
        if self.quantize_comm != "none":
            try:
                parse(self.quantize_comm)
            except ValueError as e:
                raise ValueError(f"plan.quantize_comm = {self.quantize_comm!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    """``[pipeline]``, used on a mesh with ``pp > 1``: ``schedule`` (gpipe, 1f1b, interleaved-1f1b, zero-bubble, zb-v),
    ``microbatches`` (default 2 x pp), ``repeats`` (chunks of layers per stage), ``zero3_gather`` (step,
    layer), ``recompute`` (once, per-action: :class:`zjax.Pipeline`'s), ``table`` (a file holding a schedule of
    one's own, :func:`zjax.pipeline.read_table`: it runs in place of ``schedule``, its microbatches and chunks
    those of the run)."""

    schedule: str = "gpipe"
    microbatches: int | None = None
    repeats: int = 1
    zero3_gather: str | None = None
    recompute: str = "once"
    table: Path | None = None

    def __post_init__(self) -> None:
        from ..pipeline import RECOMPUTE, SCHEDULES
        from ..pipeline._config import GATHER_MODES

        _one_of("pipeline.schedule", self.schedule, SCHEDULES)
        _at_least("pipeline.repeats", self.repeats, 1)
        if self.microbatches is not None:
            _at_least("pipeline.microbatches", self.microbatches, 1)
        if self.zero3_gather is not None:
            _one_of("pipeline.zero3_gather", self.zero3_gather, GATHER_MODES)
        _one_of("pipeline.recompute", self.recompute, RECOMPUTE)

    def build(self, stages: int) -> Any:
        """The :class:`zjax.Pipeline` these settings describe on ``stages`` (pp); a table file is read here.

        Raises:
          FileNotFoundError: ``table`` names no file.
          ValueError: a table that does not parse, or whose microbatches or chunks differ from those given.
        """
        from ..pipeline import Pipeline, read_table

        if self.table is None:
            return Pipeline(self.microbatches or 2 * stages, repeats=self.repeats, zero3_gather=self.zero3_gather,
                            schedule=self.schedule, recompute=self.recompute)  # fmt: skip
        try:
            tab = read_table(self.table)
            repeats = tab.chunks if self.repeats == 1 else self.repeats
            return Pipeline(self.microbatches or tab.microbatches, repeats=repeats, zero3_gather=self.zero3_gather,
                            schedule=tab, recompute=self.recompute)  # fmt: skip
        except ValueError as e:
            raise ValueError(f"pipeline.table: {e}") from None


@dataclasses.dataclass(frozen=True)
class OutputSection:
    """``[output]``: ``metrics_json`` (the run's figures), ``save_hf`` (the trained weights as a Hugging Face
    checkpoint, in a new or empty directory)."""

    metrics_json: Path | None = None
    save_hf: Path | None = None


SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "plan": PlanSection, "pipeline": PipelineSection,
    "optim": Optim, "loop": LoopConfig, "output": OutputSection,
}  # fmt: skip
"""The sections of a run's configuration, in the order they are printed."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of a ``zjax train`` run, one frozen section each (:data:`SECTIONS`).

    Example:
      >>> cfg = zjax.train.RunConfig.load("run.toml").override(["plan.stage=3", "optim.lr=3e-4"])
    """

    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    plan: PlanSection = PlanSection()
    pipeline: PipelineSection = PipelineSection()
    optim: Optim = Optim()
    loop: LoopConfig = LoopConfig()
    output: OutputSection = OutputSection()

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """The settings of a TOML file (sections as tables; a missing key keeps its default).

        Raises:
          FileNotFoundError: no such file.
          ValueError: not TOML, an unknown section or key (naming the closest), or a value of the wrong type.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path}: no such file.")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path}: not valid TOML ({e}).") from None
        values: dict[str, Any] = {}
        for section, table in tree.items():
            if not isinstance(table, dict):
                raise ValueError(f"config file {path}: {section} = {table!r} is outside a section; {_sections()}.")
            for key, value in table.items():
                values[f"{section}.{key.replace('-', '_')}"] = value
        return cls().replaced(values, relative_to=path.parent, where=f"config file {path}: ")

    def override(self, assignments: Iterable[str]) -> RunConfig:
        """The settings with each ``section.key=value`` applied (``value`` read as TOML, else as text; an empty
        value unsets an optional key)."""
        values: dict[str, Any] = {}
        for text in assignments:
            key, eq, raw = text.partition("=")
            if not eq or "." not in key:
                raise ValueError(f"{text!r}: an override is section.key=value, e.g. plan.stage=3 or optim.lr=3e-4.")
            values[key.strip().replace("-", "_")] = _read_value(raw.strip())
        return self.replaced(values, relative_to=Path.cwd(), where="")

    def replaced(self, values: Mapping[str, Any], relative_to: Path, where: str) -> RunConfig:
        """The settings with ``{"section.key": value}`` applied, each checked against its field's type."""
        sections = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        for dotted, value in values.items():
            section, _, key = dotted.partition(".")
            if section not in SECTIONS:
                raise ValueError(f"{where}unknown section {section!r}{_closest(section, SECTIONS)} {_sections()}.")
            hints = typing.get_type_hints(SECTIONS[section])
            if key not in hints:
                keys = [f"{section}.{k}" for k in hints]
                raise ValueError(f"{where}unknown key {dotted!r}{_closest(dotted, keys)}")
            sections[section][key] = _typed(value, hints[key], dotted, relative_to, where)
        built = {}
        for name, cls in SECTIONS.items():
            try:
                built[name] = cls(**sections[name])
            except ValueError as e:
                raise ValueError(f"{where}{e}") from None
        return RunConfig(**built)

    def to_toml(self) -> str:
        """The settings as TOML that :meth:`load` reads back (unset optional keys as comments)."""
        lines = ["# zjax train: the resolved settings (zjax train --print-config). Run them: zjax train FILE.",
                 "# Paths are relative to this file; every key is optional (zjax train --help)."]  # fmt: skip
        for name, cls in SECTIONS.items():
            lines += ["", f"[{name}]"]
            for field in dataclasses.fields(cls):
                value = getattr(getattr(self, name), field.name)
                lines.append(f"# {field.name} =" if value is None else f"{field.name} = {_toml(value)}")
        return "\n".join(lines) + "\n"


def _read_value(raw: str) -> Any:
    if raw == "":
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # plain text: optim.name=muon, plan.mesh=dp=4,tp=2


def _typed(value: Any, hint: Any, dotted: str, base: Path, where: str) -> Any:
    """``value`` as a field of type ``hint`` (``int``, ``float``, ``str``, ``bool``, ``Path``, a tuple, or one of them
    or None)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = [h for h in typing.get_args(hint) if h is not type(None)] if union else [hint]
    optional = union and type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where}{dotted} needs a value.")
    kind = options[0]
    origin = typing.get_origin(kind)
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    if kind is Path and isinstance(value, str | Path):
        return Path(value) if Path(value).is_absolute() else base / value
    if origin is tuple and isinstance(value, list | tuple) and len(value) == len(typing.get_args(kind)):
        return tuple(value)
    name = getattr(kind, "__name__", str(kind)).replace("Path", "path (text)")
    raise ValueError(f"{where}{dotted} = {value!r}: expected {name}{' or nothing' if optional else ''}.")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _closest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else "."


def _sections() -> str:
    return f"(the sections are {', '.join(SECTIONS)})"

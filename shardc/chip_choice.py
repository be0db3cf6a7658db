"""Which chip a plan is costed on: a preset by name, a TOML chip file (``--hardware-file``, as ``shardc
calibrate`` writes it), or the spec's ``hardware`` line, run as the spec's ``fusion``, ``grad_reduce`` and
``attention_kernel`` lines say (:func:`chip_for`, the one place a chip is resolved)."""

from __future__ import annotations

import math
import os
from dataclasses import fields, replace

from shardc.errors import ShardcError, clip
from shardc.files import read_text
from shardc.hardware import DEFAULT, Hardware, get_hardware
from shardc.ir.spec import FUSIONS, GRAD_REDUCES, Spec

__all__ = ["load_hardware_file", "hardware_from_mapping", "resolve_hardware", "chip_for"]


_REQUIRED = ("flops", "ici_bandwidth", "hbm_bytes", "dcn_bandwidth")


def load_hardware_file(path: str) -> Hardware:
    """A chip from TOML: the :class:`Hardware` field names as keys (``name`` optional).

    The file is read bounded and as UTF-8 (:mod:`shardc.files`); figures must be
    finite and positive, counts whole numbers (a torus side of at least 2).
    """
    import tomllib  # here, not at the top: only a file needs it (a few ms of `shardc cost`)

    try:
        data = tomllib.loads(read_text(path, what="hardware file"))
    except tomllib.TOMLDecodeError as err:
        raise ShardcError(f"hardware file {path} is not valid TOML: {err}",
                          fix="write lines like `flops = 4.59e14`") from None
    _check_file_values(data, path)
    return hardware_from_mapping(data, source=path)


_FIGURE_RANGE = (1e-30, 1e30)


def _check_file_values(data: dict[str, object], path: str) -> None:
    """Types and ranges the dataclass cannot check: finite figures, whole counts, text names."""
    for key, value in data.items():
        if key in ("name", "description"):
            if not isinstance(value, str):
                raise ShardcError(f"{path}: {key} must be a string, got {value!r}",
                                  fix=f'write e.g. `{key} = "my-chip"`')
        elif isinstance(value, int | float) and not isinstance(value, bool) and not math.isfinite(value):
            raise ShardcError(f"{path}: {key} must be a finite number, got {value!r}",
                              fix=f"write e.g. `{key} = 1e11`")
        elif isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and \
                not _FIGURE_RANGE[0] <= value <= _FIGURE_RANGE[1]:
            # beyond any chip; the ratios of such figures (C / W) would overflow a float
            raise ShardcError(f"{path}: {key} = {value!r} is outside 1e-30..1e30",
                              fix=f"write e.g. `{key} = 1e11`")
    for key, least, example in (("ici_domain", 1, 8), ("torus_side", 2, 16), ("torus_dims", 1, 3), ("sms", 1, 132),
                                ("collective_sms", 1, 24)):
        value = data.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole or value < least:  # type: ignore[operator]
            raise ShardcError(f"{path}: {key} must be a whole number of at least {least}, got {value!r}",
                              fix=f"write e.g. `{key} = {example}`")


def hardware_from_mapping(data: dict[str, object], source: str = "<hardware>") -> Hardware:
    """Validate keys and values: unknown keys, missing ones and non-positive figures are errors.

    ``base = "a100"`` starts from that preset, the file's keys replacing its figures (a cluster whose
    network differs from the preset's, say), so a chip's measured curves are never copied by hand."""
    known = {f.name for f in fields(Hardware)} - {"chip"} | {"base"}  # a file's chip is its base's
    unknown = sorted(set(data) - known)
    if unknown:
        raise ShardcError(f"{source}: unknown key(s) {', '.join(unknown)}",
                          fix="use the keys " + ", ".join(sorted(known)))
    base = _base_preset(data, source)
    missing = [k for k in _REQUIRED if k not in data] if base is None else []
    if missing:
        raise ShardcError(f"{source}: missing key(s) {', '.join(missing)}",
                          fix="give at least " + ", ".join(_REQUIRED) + ', or `base = "a100"` (a preset to start from)')
    values: dict[str, object] = {"name": str(data.get("name", source)),
                                 "description": str(data.get("description", "" if base is None else base.description))}
    for key in ("flops", "ici_bandwidth", "hbm_bytes", "hbm_bandwidth", "dcn_bandwidth", "hop_latency",
                "ici_efficiency", "nvls_efficiency", "dcn_efficiency", "hbm_efficiency", "matmul_hbm_efficiency",
                "flops_f8", "bucket_bytes", "collective_base",
                "host_bandwidth", "host_adam_rate"):
        if key in data:
            values[key] = _positive(data[key], key, source)
    if base is None:
        values.setdefault("hbm_bandwidth", math.inf)
    for key in ("ici_domain", "torus_side", "torus_dims", "sms", "collective_sms"):
        if data.get(key) is not None:
            values[key] = int(_positive(data[key], key, source))
    if "book" in data:
        if not isinstance(data["book"], bool):
            raise ShardcError(f"{source}: book must be true or false, got {data['book']!r}", fix="write `book = true`")
        values["book"] = data["book"]
    for key, unit in (("matmul_efficiency", "flops"), ("matmul_efficiency_f8", "flops"), ("attention_forward", "keys"),
                      ("attention_backward", "keys")):
        if key in data:
            values[key] = _efficiency_points(data[key], source, key, unit)
    if "attention_kernel" in data:
        raise ShardcError(f"{source}: a hardware file gives its attention kernel's rates, not its name",
                          fix="write attention_forward = [[keys, fraction], ...] and attention_backward alike")
    for key, choices in (("fusion", FUSIONS), ("grad_reduce", GRAD_REDUCES)):
        if key in data:
            if data[key] not in choices:
                raise ShardcError(f"{source}: {key} must be one of {', '.join(choices)}, got {clip(repr(data[key]))}",
                                  fix=f'write e.g. `{key} = "{choices[0]}"`')
            values[key] = data[key]
    if base is not None:  # the base's chip, so the kernels measured on it run on this one
        return replace(base, chip=base.chip or base.name, **values)  # type: ignore[arg-type]
    return Hardware(**values)  # type: ignore[arg-type]


def _base_preset(data: dict[str, object], source: str) -> Hardware | None:
    """The preset a file's ``base`` key names, or None where it has none."""
    if "base" not in data:
        return None
    if not isinstance(data["base"], str):
        raise ShardcError(f"{source}: base must be a preset's name, got {clip(repr(data['base']))}",
                          fix='write e.g. `base = "a100"`')
    return get_hardware(data["base"])


def _efficiency_points(value: object, source: str, key: str = "matmul_efficiency",
                       unit: str = "flops") -> tuple[tuple[float, float], ...]:
    """``key = [[x, fraction], ...]``: ``unit`` rising (FLOPs of one matmul; keys of an attention kernel's
    call), each fraction in (0, 1]."""
    example = "[[1e9, 0.3], [1e12, 0.8]]" if unit == "flops" else "[[1024, 0.4], [16384, 0.6]]"
    fix = f"write e.g. `{key} = {example}` ({unit}, fraction of peak)"
    if not isinstance(value, list) or not value:
        raise ShardcError(f"{source}: {key} must be a list of [{unit}, fraction] pairs", fix=fix)
    points = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ShardcError(f"{source}: {key} has {clip(repr(pair))}, not a [{unit}, fraction] pair", fix=fix)
        x, fraction = (_positive(v, key, source) for v in pair)
        if fraction > 1:
            raise ShardcError(f"{source}: {key} fraction {fraction!r} is above 1 (the peak)", fix=fix)
        points.append((x, fraction))
    if any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ShardcError(f"{source}: {key}'s {unit} must rise from pair to pair", fix=fix)
    return tuple(points)


def _positive(value: object, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ShardcError(f"{source}: {key} must be a positive number, got {value!r}",
                          fix=f"write e.g. `{key} = 1e11`")
    return float(value)


def resolve_hardware(hardware: str | Hardware | None, hardware_file: str | None = None,
                     spec: Spec | str | None = None) -> Hardware:
    """The chip to cost on: a file beats a name given here, which beats the spec's (or a preset's name given
    for it), then tpu-v5p.

    The spec's ``hardware`` line names a preset or a hardware file (``hardware a100_jean_zay.toml``), a
    relative path read beside the spec's own file; an error in that file points at the line."""
    if hardware_file is not None:
        return load_hardware_file(hardware_file)
    if isinstance(hardware, Hardware):
        return hardware
    named = spec.hardware if isinstance(spec, Spec) else spec
    if hardware is None and isinstance(spec, Spec) and named is not None and named.endswith(".toml"):
        try:
            return load_hardware_file(beside(named, spec.filename))
        except ShardcError as err:
            raise ShardcError(err.message, err.span or spec.span_of("hardware"), fix=err.fix) from None
    return get_hardware(hardware or named or DEFAULT)


def beside(path: str, spec_file: str | None) -> str:
    """``path`` as the spec at ``spec_file`` means it: relative to the spec's folder (as written where the
    spec has no file)."""
    if os.path.isabs(path) or spec_file is None or spec_file.startswith("<"):
        return path
    return os.path.join(os.path.dirname(spec_file), path)


def chip_for(spec: Spec, hardware: str | Hardware | None = None, hardware_file: str | None = None) -> Hardware:
    """The chip ``spec`` is planned and costed on (:func:`resolve_hardware`, the spec's ``hardware`` line
    last), run as the spec's ``fusion``, ``grad_reduce`` and ``attention_kernel`` lines say where the chip
    given does not set them (a flag beats the spec's line)."""
    hw = resolve_hardware(hardware, hardware_file, spec)
    fusion, grad_reduce = hw.fusion or spec.fusion, hw.grad_reduce or spec.grad_reduce
    if (fusion, grad_reduce) != (hw.fusion, hw.grad_reduce):
        hw = replace(hw, fusion=fusion, grad_reduce=grad_reduce)
    if hw.attention_kernel is None and spec.attention_kernel is not None:
        try:
            hw = hw.with_attention(spec.attention_kernel)
        except ShardcError as err:  # the spec's line names a kernel this chip (a --hardware flag's) has no rates of
            raise ShardcError(err.message, spec.span_of("attention_kernel"), fix=err.fix) from None
    if hw.param_gather is None and spec.param_gather is not None:
        hw = replace(hw, param_gather=spec.param_gather)
    return hw

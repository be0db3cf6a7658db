"""Hardware presets (the chips' data-sheet figures) and a user's own chip from a TOML file.

Every figure is per chip.  ``ici_bandwidth`` is the *one-way* bandwidth of one
link, as the data sheets give it; on a torus the cost model uses
the bidirectional figure ``w_ici = 2 * ici_bandwidth`` for one mesh axis, as the
book does (TPU v5p: 2 * 9e10 = 1.8e11, so C / W_ici = 4.59e14 / 1.8e11 = 2550).  A GPU's
``ici_bandwidth`` is its whole NVLink egress, one way (H100: 450 GB/s), used as is, at the
``ici_efficiency`` NCCL reaches (:attr:`Hardware.w_ici`).
``dcn_bandwidth`` (DCN on TPU, InfiniBand on GPU) is used as given: the book's
per-chip 6.25e9 gives C / W_dcn = 73,440 on v5p.

Figures beyond the book's (HBM bandwidth, the DCN figure of TPUs other
than v5p) are the public data-sheet numbers; a chip that differs can be given
with ``--hardware-file chip.toml`` using the field names below as keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from shardc.errors import ShardcError, clip
from shardc.files import read_text
from shardc.ir.spec import Mesh, Network

__all__ = ["Hardware", "PRESETS", "DEFAULT", "get_hardware", "load_hardware_file", "resolve_hardware",
           "hardware_from_mapping", "default_spans", "check_spans", "check_hardware_arg"]

DEFAULT = "tpu-v5p"


@dataclass(frozen=True)
class Hardware:
    """One accelerator chip, per-chip figures in bytes, bytes/s and FLOPs/s."""

    name: str
    flops: float  # C: dense bf16 FLOPs/s
    ici_bandwidth: float  # one-way bytes/s of one ICI / NVLink link (per direction)
    hbm_bytes: float
    hbm_bandwidth: float
    dcn_bandwidth: float  # bytes/s per chip over DCN / InfiniBand, used as is
    hop_latency: float = 1e-6  # seconds a hop; bounds the time of small collectives
    ici_domain: int | None = None  # chips reachable over ICI/NVLink (8 per H100 node); None: a pod
    description: str = ""
    torus_side: int | None = None  # chips along one torus axis (16 on TPU pods); None: no torus
    torus_dims: int = 1  # axes of the torus (3 for v4p/v5p, 2 for v5e/v6e)
    # the share of the link figure a large collective reaches (NCCL's bus bandwidth over the data sheet's)
    ici_efficiency: float = 1.0
    book: bool = False  # the book's assumptions: spans by ceil(log16 n), no topology, no efficiency

    def spans(self, chips: int) -> int:
        """Torus axes a mesh axis of ``chips`` chips is laid over: ceil(log_side chips), at most the torus's.

        This is the book's M_X: X = 1024 on a 16x16x16 v5p pod spans 3 axes, so its
        collectives have 3 axes' links.  An axis of at most ``torus_side`` chips spans 1.
        """
        if self.torus_side is None or chips <= self.torus_side:
            return 1
        k = math.ceil(math.log(chips) / math.log(self.torus_side) - 1e-9)
        return max(1, min(k, self.torus_dims))

    @property
    def w_ici(self) -> float:
        """The W_ici of the formulas: on a torus, one axis's bidirectional bandwidth (twice the one-way
        link figure); on a GPU, its NVLink egress, one way, at the share collectives reach.

        A GPU's ``ici_bandwidth`` is already the sum over its NVLink links (H100: 18 links, 450 GB/s
        each way), the book's W_GPU egress ("How To Scale Your Model", the GPU chapter: C / W is
        about 2200 on an H100); a ring over the NVSwitch sends (n-1)/n of V out of each GPU
        (:mod:`shardc.collectives`).  The book's assumptions (``book``) leave out the efficiency.
        """
        if self.ici_domain is not None:
            return self.ici_bandwidth * (1.0 if self.book else self.ici_efficiency)
        return 2.0 * self.ici_bandwidth

    @property
    def w_dcn(self) -> float:
        return self.dcn_bandwidth

    @property
    def intensity_ici(self) -> float:
        """C / W_ici: FLOPs a byte over ICI must pay for (2550 on tpu-v5p)."""
        return self.flops / self.w_ici

    @property
    def intensity_dcn(self) -> float:
        return self.flops / self.w_dcn

    def scaled(self, bandwidth: float = 1.0, flops: float = 1.0) -> Hardware:
        """The same chip with every bandwidth (ICI, DCN) and/or FLOPs/s scaled (for what-ifs)."""
        return replace(self, flops=self.flops * flops, ici_bandwidth=self.ici_bandwidth * bandwidth,
                       dcn_bandwidth=self.dcn_bandwidth * bandwidth)


# NCCL's measured AllReduce bus bandwidth inside an 8xH100 node, SHARP off, is close to 370 GB/s of
# NVLink's 450 GB/s each way ("How To Scale Your Model", the GPU chapter, its empirical AllReduce
# figure); the H200 has the same NVLink 4 and NVSwitch
_NCCL_H100 = 370e9 / 450e9

PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("tpu-v4p", 2.75e14, 4.5e10, 32e9, 1.2e12, 6.25e9, description="TPU v4p, 3D torus",
                 torus_side=16, torus_dims=3),
        Hardware("tpu-v5e", 1.97e14, 4.5e10, 16e9, 8.1e11, 6.25e9, description="TPU v5e, 2D torus",
                 torus_side=16, torus_dims=2),
        Hardware("tpu-v5p", 4.59e14, 9e10, 96e9, 2.8e12, 6.25e9, description="TPU v5p, 3D torus",
                 torus_side=16, torus_dims=3),
        Hardware("tpu-v6e", 9.2e14, 9e10, 32e9, 1.64e12, 6.25e9, description="TPU v6e, 2D torus",
                 torus_side=16, torus_dims=2),
        Hardware("h100", 9.89e14, 4.5e11, 80e9, 3.35e12, 5e10, ici_domain=8, ici_efficiency=_NCCL_H100,
                 description="H100 SXM: NVLink within a node of 8, InfiniBand across"),
        Hardware("h200", 9.89e14, 4.5e11, 141e9, 4.8e12, 5e10, ici_domain=8, ici_efficiency=_NCCL_H100,
                 description="H200: an H100 with 141 GB HBM3e"),
    )
}

_REQUIRED = ("flops", "ici_bandwidth", "hbm_bytes", "dcn_bandwidth")


def get_hardware(name: str) -> Hardware:
    """A preset by name (case-insensitive, ``_`` or ``-``); the error lists the presets."""
    key = name.strip().lower().replace("_", "-")
    if key in PRESETS:
        return PRESETS[key]
    raise ShardcError(f"unknown hardware {name!r}",
                      fix="use one of " + ", ".join(PRESETS) + ", or --hardware-file chip.toml")


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
    for key, least, example in (("ici_domain", 1, 8), ("torus_side", 2, 16), ("torus_dims", 1, 3)):
        value = data.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole or value < least:  # type: ignore[operator]
            raise ShardcError(f"{path}: {key} must be a whole number of at least {least}, got {value!r}",
                              fix=f"write e.g. `{key} = {example}`")


def hardware_from_mapping(data: dict[str, object], source: str = "<hardware>") -> Hardware:
    """Validate keys and values: unknown keys, missing ones and non-positive figures are errors."""
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ShardcError(f"{source}: unknown key(s) {', '.join(unknown)}",
                          fix="use the keys " + ", ".join(sorted(known)))
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ShardcError(f"{source}: missing key(s) {', '.join(missing)}",
                          fix="give at least " + ", ".join(_REQUIRED))
    values: dict[str, object] = {"name": str(data.get("name", source)),
                                 "description": str(data.get("description", ""))}
    for key in ("flops", "ici_bandwidth", "hbm_bytes", "hbm_bandwidth", "dcn_bandwidth", "hop_latency",
                "ici_efficiency"):
        if key in data:
            values[key] = _positive(data[key], key, source)
    values.setdefault("hbm_bandwidth", math.inf)
    for key in ("ici_domain", "torus_side", "torus_dims"):
        if data.get(key) is not None:
            values[key] = int(_positive(data[key], key, source))
    if "book" in data:
        if not isinstance(data["book"], bool):
            raise ShardcError(f"{source}: book must be true or false, got {data['book']!r}", fix="write `book = true`")
        values["book"] = data["book"]
    return Hardware(**values)  # type: ignore[arg-type]


def _positive(value: object, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ShardcError(f"{source}: {key} must be a positive number, got {value!r}",
                          fix=f"write e.g. `{key} = 1e11`")
    return float(value)


def resolve_hardware(hardware: str | Hardware | None, hardware_file: str | None = None,
                     spec_hardware: str | None = None) -> Hardware:
    """The chip to cost on: a file beats a name given here, which beats the spec's, then tpu-v5p."""
    if hardware_file is not None:
        return load_hardware_file(hardware_file)
    if isinstance(hardware, Hardware):
        return hardware
    return get_hardware(hardware or spec_hardware or DEFAULT)


def default_spans(mesh: Mesh, hw: Hardware, sizes: dict[str, int] | None = None) -> dict[str, int]:
    """Each ICI mesh axis's torus axes on this chip (:meth:`Hardware.spans`); DCN axes have none."""
    given = sizes or {}
    return {a.name: hw.spans(given.get(a.name, a.size)) for a in mesh.axes if a.network is not Network.DCN}


def check_spans(mesh: Mesh, spans: Mapping[str, int] | None) -> None:
    """Spans given over the chip's defaults: each names a mesh axis and is a whole number >= 1 (not a
    boolean) of physical axes of 2 chips or more, so at most log2 of the axis's devices.

    The one check of spans: the CLI's ``--spans``, the planner, ``cost`` and the formulas call it.
    """
    for axis, k in (spans or {}).items():
        if axis not in mesh.names:
            raise ShardcError(f"--spans {clip(str(axis))}: not a mesh axis", fix="use one of " + ", ".join(mesh.names))
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ShardcError(f"--spans {axis}={clip(repr(k))}: must be a whole number >= 1",
                              fix="write e.g. --spans X=3")
        size = mesh.axis(axis).size
        if k > 1 and 2 ** min(k, 64) > size:
            raise ShardcError(f"--spans {axis}={clip(str(k))}: an axis of {size} chips spans at most "
                              f"{max(1, size.bit_length() - 1)} physical axes (each has 2 chips or more)",
                              fix=f"write e.g. --spans {axis}=1")


def check_hardware_arg(hardware: object) -> None:
    """``None``, a preset name or a :class:`shardc.hardware.Hardware`."""
    if hardware is None or isinstance(hardware, Hardware):
        return
    if not isinstance(hardware, str):
        raise TypeError(f"hardware must be a preset name, a Hardware or None, not {type(hardware).__name__}")
    if not hardware.strip():
        raise ShardcError("hardware is an empty name", fix="name a preset (see `shardc hardware`), or pass None")

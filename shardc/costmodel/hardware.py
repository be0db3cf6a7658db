"""The chips, re-exported from :mod:`shardc.hardware` (where the planner reads them too)."""

from shardc.hardware import (
    DEFAULT,
    PRESETS,
    Hardware,
    default_spans,
    get_hardware,
    hardware_from_mapping,
    load_hardware_file,
    resolve_hardware,
)

__all__ = ["Hardware", "PRESETS", "DEFAULT", "get_hardware", "load_hardware_file", "resolve_hardware",
           "hardware_from_mapping", "default_spans"]

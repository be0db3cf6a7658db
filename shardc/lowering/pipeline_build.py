"""A lowered pipeline module's :class:`~shardc.lowering.pipeline_runtime.Pipeline`, built from its globals.

A lowered pipeline module's globals are its tables (each part's phase functions and their in and out
specs, the tick tables, the mesh, the ends' names: :mod:`shardc.lowering.pipeline_lowering` and
:mod:`shardc.lowering.pipeline_ends` write them); these read them into its pipeline, so the module
holds data and one call (``PIPELINE = model_pipeline(globals())``), and the code is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardc.lowering.pipeline_bodies import Body
from shardc.lowering.pipeline_parts import BlockEnds, Ends, ModelEnds, Part, Phase
from shardc.lowering.pipeline_routes import Placement
from shardc.lowering.pipeline_runtime import Pipeline

__all__ = ["block_pipeline", "model_pipeline"]


def _part(tables: Mapping[str, Any], prefix: str, result: str) -> Part:
    """A part's phase functions and tables as a lowered module names them: ``forward_local``,
    ``FORWARD_IN``, ... for the block, prefixed (``pre_forward_local``, ``PRE_FORWARD_IN``) for an end."""
    fn, table = (prefix.lower() + "_", prefix + "_") if prefix else ("", "")
    return Part(tables[fn + "forward_local"], tables[table + "FORWARD_IN"], tables[table + "FORWARD_OUT"],
                tables[fn + "backward_local"], tables[table + "BACKWARD_IN"], tables[table + "BACKWARD_OUT"],
                tables[table + "COTANGENTS"], tables[table + "GRADS"], result, tables.get(table + "KEYED", False),
                tables.get(fn + "reduce_local"), tables.get(table + "REDUCE_IN"), tables.get(table + "REDUCE_OUT"),
                tables.get(table + "FINAL_GRADS"), _phase(tables, fn + "input_backward"),
                _phase(tables, fn + "weight_backward"))


def _phase(tables: Mapping[str, Any], name: str) -> Phase | None:
    """A phase function and its in and out tables, where the module has them (``input_backward_local``,
    ``INPUT_BACKWARD_IN``, ``INPUT_BACKWARD_OUT``)."""
    fn = tables.get(name + "_local")
    return None if fn is None else (fn, tables[name.upper() + "_IN"], tables[name.upper() + "_OUT"])


def _pipeline(tables: Mapping[str, Any], ends: Ends) -> Pipeline:
    """The block's layers over the stages in the tick tables' order, ``ends`` around it."""
    block = _part(tables, "", tables["BLOCK_OUTPUT"])
    counts = tables.get("BLOCK_LAYERS", (tables["LAYERS"],))
    more = tuple(Body(_part(tables, b["prefix"], b["output"]), b["input"], b["params"], n)
                 for b, n in zip(tables.get("MORE_BLOCKS", ()), counts[1:], strict=True))
    return Pipeline(tables["PIPE_MESH_AXES"], tables["PIPELINE_AXIS"], tables["LAYERS"], tables["MICROBATCHES"],
                    tables["F_TABLE"], tables["B_TABLE"], block, tables["BLOCK_INPUT"], tables["PARAMS"], ends,
                    tables["DATA_DIM"], tables.get("CHUNKS", 1), tables.get("STAGE_LAYERS"), tables.get("W_TABLE"),
                    tables.get("V_SHAPE", False), tables.get("TWO_WAY", False), tables.get("SEQUENCE_ZIGZAG", {}),
                    tables.get("SEQUENCE_CHUNKS", 0), more, counts, tables.get("FED", ()), tables.get("RIDERS", ()))


def _placement(tables: Mapping[str, Any]) -> Placement:
    """Where the module's chunks sit (:mod:`shardc.lowering.pipeline_routes`)."""
    stages = tables["PIPE_MESH_AXES"][tables["PIPELINE_AXIS"]]
    return Placement(stages, tables.get("CHUNKS", 1), tables.get("V_SHAPE", False), tables.get("TWO_WAY", False))


def _both(tables: Mapping[str, Any]) -> tuple[int, ...]:
    """DualPipe's two devices that each run both ends; () where one runs each."""
    place = _placement(tables)
    return place.end_stages if place.two_way else ()


def block_pipeline(tables: Mapping[str, Any]) -> Pipeline:
    """A block alone's pipeline from a lowered module's globals: stage 0 reads the microbatches of
    ``BLOCK_INPUT``, the last stage keeps ``BLOCK_OUTPUT`` and reads its cotangent ``OUTPUT_COTANGENT``."""
    first, out = tables["BLOCK_INPUT"], tables["BLOCK_OUTPUT"]
    ends = BlockEnds(first, out, tables["FORWARD_IN"][first], tables["FORWARD_OUT"][out], tables["GRADS"][first],
                     tables["OUTPUT_COTANGENT"], _placement(tables).last_stage, _both(tables))
    return _pipeline(tables, ends)


def model_pipeline(tables: Mapping[str, Any]) -> Pipeline:
    """A whole model's pipeline from a lowered module's globals: the statements before the block
    (``pre_*``, ``PRE_*``, making ``PRE_RESULT``) on stage 0, those after it (``post_*``, ``POST_*``,
    ending in ``LOSS``) on the last."""
    pre, post = _part(tables, "PRE", tables["PRE_RESULT"]), _part(tables, "POST", tables["LOSS"])
    ends = ModelEnds(pre, post, tables["PRE_DATA"], tables["POST_DATA"], tables["PRE_PARAMS"], tables["POST_PARAMS"],
                     ({"output": tables["BLOCK_OUTPUT"]}, *tables.get("MORE_BLOCKS", ()))[-1]["output"],
                     tuple(tables.get("TIED", {})), tables["PIPELINE_AXIS"],
                     tables["PIPE_MESH_AXES"][tables["PIPELINE_AXIS"]], _placement(tables).last_stage, _both(tables),
                     tables.get("W_TABLE") is not None, tables.get("PRE_WHOLE", ()), tables.get("POST_WHOLE", ()),
                     tables.get("FED", ()), tables.get("RIDERS", ()))
    return _pipeline(tables, ends)

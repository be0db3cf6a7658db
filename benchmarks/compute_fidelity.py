"""Matmul rates: published measurements beside the rate shardc's compute model predicts, and their ratio.

    python benchmarks/compute_fidelity.py

Each row is one published matmul measurement: the chip, the shape (batch x m x n x k), the FLOP/s
measured and the FLOP/s the model gives the same matmul (the chip's peak times
:meth:`shardc.hardware.Hardware.efficiency` of its FLOPs).  "fit" rows are the points the chip's
curve is made of (``shardc/kernel_rates.py`` cites them), so their ratio is 1 by construction, or within
the class's spread where the curve is a class's mean (the A100's two large-matmul figures); "held
out" rows are measurements of other shapes, from the same tables or other sources, that the curve
never saw: their ratio is the model's error.
"""

from __future__ import annotations

import math

from shardc.chip_model import interpolate
from shardc.hardware import get_hardware

XLA = "XLA GPU matmul table (matmul_interpolator_data.h)"
# (chip, batch, m, n, k, measured FLOP/s, source, whether the curve is made of it)
POINTS: tuple[tuple[str, int, int, int, int, float, str, bool], ...] = (
    ("h100", 1, 256, 512, 256, 1.1459846994535e13, XLA + " sm_90", True),
    ("h100", 1, 1024, 1024, 512, 1.45572373101952e14, XLA + " sm_90", True),
    ("h100", 4, 1024, 1024, 1024, 4.89845722627737e14, XLA + " sm_90", True),
    ("h100", 1, 2048, 2048, 2048, 6.3198459329017e14, XLA + " sm_90", True),
    ("h100", 1, 4096, 4096, 4096, 7.83328793548203e14, XLA + " sm_90", True),
    ("h100", 2, 4096, 4096, 4096, 8.0767101419194e14, XLA + " sm_90", True),
    ("h100", 1, 256, 4096, 256, 7.8033562790697e13, XLA + " sm_90", False),
    ("h100", 2, 512, 512, 2048, 2.16480206451612e14, XLA + " sm_90", False),
    ("h100", 1, 1024, 1024, 2048, 3.49981037809648e14, XLA + " sm_90", False),
    ("h100", 1, 4096, 512, 1024, 3.70767204419889e14, XLA + " sm_90", False),
    ("h100", 1, 2048, 4096, 1024, 5.94212409518539e14, XLA + " sm_90", False),
    ("h100", 4, 2048, 2048, 2048, 7.25746417032781e14, XLA + " sm_90", False),
    ("h100", 1, 4096, 4096, 2048, 7.38736406437117e14, XLA + " sm_90", False),
    ("h100", 1, 4096, 1024, 4096, 7.38474431911967e14, XLA + " sm_90", False),
    ("h100", 1, 4224, 2048, 8192, 7.801689058368037e14, "H100 peak matmul gist (Chillee), torch max-autotune", False),
    ("h100", 1, 6144, 17920, 2816, 7.921e14, "ml-engineering MAMF table, H100 SXM", False),
    ("b200", 1, 256, 256, 256, 6.765006451612e12, XLA + " sm_100", True),
    ("b200", 1, 512, 512, 512, 4.8480306303052e13, XLA + " sm_100", True),
    ("b200", 1, 1024, 1024, 4096, 6.75256237088279e14, XLA + " sm_100", True),
    ("b200", 1, 2048, 2048, 2048, 9.85762519164562e14, XLA + " sm_100", True),
    ("b200", 1, 4096, 4096, 4096, 1.416867213789406e15, XLA + " sm_100", True),
    ("b200", 1, 256, 4096, 1024, 2.92333739177783e14, XLA + " sm_100", False),
    ("b200", 1, 4096, 2048, 2048, 1.170011862566826e15, XLA + " sm_100", False),
    ("b200", 1, 1024, 4096, 4096, 1.213953447145279e15, XLA + " sm_100", False),
    ("b200", 1, 2048, 4096, 4096, 1.342544381979447e15, XLA + " sm_100", False),
    ("a100", 1, 6912, 16384, 2048, 2.679e14, "ml-engineering MAMF table, A100 SXM", True),
    ("a100", 1, 8192, 8192, 8192, 2.57e14, "Horace He, thonking.ai 2024, cuBLAS on randn inputs", True),
    ("tpu-v5e", 1, 4096, 4096, 4096, 1.6613153396399134e14, "JAX Pallas TPU matmul guide, XLA matmul", True),
    ("tpu-v5e", 1, 8192, 8192, 8192, 1.8182317539503744e14, "JAX Pallas TPU matmul guide, XLA matmul", True),
)


def rows() -> list[tuple[str, str, float, float, float, str, str]]:
    """(chip, shape, published, predicted, ratio predicted/published, fit or held out, source) a point."""
    out = []
    for chip, b, m, n, k, measured, source, fit in POINTS:
        hw = get_hardware(chip)
        flops = 2.0 * b * m * n * k
        predicted = hw.flops * hw.efficiency(flops)
        out.append((chip, f"{b}x{m}x{n}x{k}", measured, predicted, predicted / measured,
                    "fit" if fit else "held out", source))
    return out


def wave_share(b: int, m: int, n: int, sms: int) -> float:
    """The share of the SMs a matmul's output tiles keep busy over whole waves: 256 x 128 tiles (the larger
    side along the larger of m and n), one a streaming multiprocessor at a time (wave quantization, NVIDIA's
    "Matrix Multiplication Background User's Guide", section 3.2)."""
    tiles = b * math.ceil(max(m, n) / 256) * math.ceil(min(m, n) / 128)
    return tiles / (math.ceil(tiles / sms) * sms)


def wave_errors() -> list[float]:
    """|ratio - 1| of each held-out point of a chip with a streaming-multiprocessor count when the curve is of
    the fit points' rates over their wave share and each matmul runs at the curve times its own: the
    alternative to a curve in FLOPs alone that the module's table is compared with."""
    out = []
    for chip in sorted({p[0] for p in POINTS}):
        hw = get_hardware(chip)
        if hw.sms is None:
            continue
        fit = tuple(sorted((2.0 * b * m * n * k, rate / hw.flops / wave_share(b, m, n, hw.sms))
                           for c, b, m, n, k, rate, _, is_fit in POINTS if c == chip and is_fit))
        for c, b, m, n, k, rate, _, is_fit in POINTS:
            if c == chip and not is_fit:
                predicted = hw.flops * interpolate(fit, 2.0 * b * m * n * k) * wave_share(b, m, n, hw.sms)
                out.append(abs(predicted / rate - 1))
    return out


def main() -> None:
    print(f"{'chip':<8} {'shape b x m x n x k':<22} {'published':>10} {'predicted':>10} {'ratio':>6}  {'':<8}  source")
    held = []
    for chip, shape, measured, predicted, ratio, kind, source in rows():
        print(f"{chip:<8} {shape:<22} {measured / 1e12:>8.1f} T {predicted / 1e12:>8.1f} T {ratio:>6.3f}  "
              f"{kind:<8}  {source}")
        if kind == "held out":
            held.append(abs(ratio - 1))
    if held:
        print(f"held-out points: {len(held)}, mean |ratio - 1| {sum(held) / len(held):.1%}, worst {max(held):.1%}")
    waves = wave_errors()
    if waves:
        print(f"with wave quantization (256 x 128 tiles over the SMs), the held-out points of chips with an SM count: "
              f"{len(waves)}, mean |ratio - 1| {sum(waves) / len(waves):.1%}, worst {max(waves):.1%}")


if __name__ == "__main__":
    main()

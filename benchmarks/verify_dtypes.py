"""The rounding error verify meets per dtype: the figures behind ``shardc.verification.report.TOLERANCE``.

    python benchmarks/verify_dtypes.py [--dtypes f32,bf16,f16,f8] [examples/*.shard ...]

Runs ``verify`` on every example with its dtype replaced by each of ``--dtypes`` (8
emulated CPU devices) and prints, per example and dtype, the worst max|err| over
max|terms| (the magnitude the bound scales, ``reference.magnitudes``) of any value,
next to the rtol it must stay under, and whether verification passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="spec files (default: examples/*.shard)")
    parser.add_argument("--dtypes", default="f32,bf16,f16,f8", help="comma-separated spec dtypes")
    args = parser.parse_args()
    import shardc
    from shardc.ir.spec import DType
    from shardc.verification.verify import verify

    root = Path(__file__).resolve().parent.parent
    files = [Path(f) for f in args.files] or sorted((root / "examples").glob("*.shard"))
    worst: dict[str, float] = {}
    print(f"{'example':<20} {'dtype':<5} {'compute':<9} {'err/terms':>10} {'rtol':>8} {'scale':>7}  ok")
    for path in files:
        spec = shardc.parse(path.read_text(), filename=str(path))
        for name in args.dtypes.split(","):
            report = verify(dataclasses.replace(spec, dtype=DType(name)))
            rtol, atol = report.tolerance
            # bound = atol + rtol * terms, so terms = (bound - atol) / rtol
            ratio = max(max(r.max_error - atol, 0.0) * rtol / max(r.tolerance - atol, 1e-300)
                        for r in report.values)
            worst[name] = max(worst.get(name, 0.0), ratio)
            print(f"{path.stem:<20} {name:<5} {report.compute_dtype:<9} {ratio:>10.2e} {rtol:>8.1e} "
                  f"{report.input_scale:>7g}  {'yes' if report.ok else 'NO'}")
    print("worst err/terms: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The one comparison of two training curves: "this layout gives the one-process curve" (tests, the layout fuzzer).

Two runs of the same seed agree when they have the same steps and, at each, the same loss, global gradient norm
and validation loss (and, for a mixture, each source's validation loss ``val_loss/<source>``) up to the order of
floating-point reductions: relative ``REL`` in fp32. A different layout
sums the same numbers in another order (a tp all-reduce, a dp reduce-scatter, micro-batches accumulated in
another grouping), so bit equality is not the claim; a wrong gradient or a lost micro-batch is far outside it.
"""

from __future__ import annotations

import math

REL = 2e-4  # fp32, up to the order of floating-point reductions
KEYS = ("loss", "grad_norm", "val_loss")
PER_SOURCE = "val_loss/"  # a mixture's validation loss of each source


def curve_mismatches(expected: list[dict], got: list[dict], rel: float = REL) -> list[str]:
    """Every way ``got`` (metrics rows) departs from ``expected``: a missing or extra step, a figure present in
    one and not the other, or one further apart than ``rel``. Empty when the curves agree."""
    steps = ([r["step"] for r in expected], [r["step"] for r in got])
    if steps[0] != steps[1]:
        return [f"steps differ: expected {steps[0]}, got {steps[1]}"]
    out = []
    for want, have in zip(expected, got, strict=True):
        per_source = sorted({k for k in (*want, *have) if k.startswith(PER_SOURCE)})
        for key in (*KEYS, *per_source):
            if (key in want) != (key in have):
                out.append(f"step {want['step']}: {key} in only one of the runs")
            elif key in want and not math.isclose(have[key], want[key], rel_tol=rel):
                out.append(f"step {want['step']}: {key} {have[key]!r} != {want[key]!r} (rel {rel:g})")
    return out

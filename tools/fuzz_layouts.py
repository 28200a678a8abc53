"""Random layouts against one process: every case a random configuration, refused as docs/configuration.md says or
training to the one-process curve, resuming under another layout and leaving by every exit its model has (the
consolidated file, generation, init_from, Hugging Face export) with the trained model's logits (trident_dev/fuzz/ says
what is checked).

    python tools/fuzz_layouts.py --cases 200 --seed 1     # a sweep; ends with `fuzz: P/N cases passed ...`
    python tools/fuzz_layouts.py --seed 1 --case 17       # one case again, as a failing case's line says
    python tools/fuzz_layouts.py --cover 1000 --dry-run   # the cheapest of the first 1000 that cover everything

Exits 1 when any case fails. Run from a checkout: it trains through the checkout's train.py and conf/.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from trident_dev.fuzz import Fuzzer, draw_case, prepare_corpus
from trident_dev.fuzz.cover import cheapest_cover, draw_facts, estimated_seconds, missing
from trident_dev.ranks import start_fork_server

REPO = Path(__file__).resolve().parent.parent


RANK_PRELOAD = ["trident_dev.fuzz", "trident.build", "trident.loop", "hydra", "torch._dynamo"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=20, help="cases to draw (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the sweep's seed (default 0)")
    parser.add_argument("--case", type=int, action="append", help="run only this case index (repeatable)")
    parser.add_argument(
        "--cover",
        type=int,
        metavar="N",
        help="of the first N cases, run only the cheapest sample that trains every knob value and pair and is refused "
        "with every listed refusal (trident_dev/fuzz/cover.py; drawing N cases through the validator takes ~0.5 s of a "
        "core each, on --jobs processes)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes drawing --cover's cases")
    parser.add_argument("--dry-run", action="store_true", help="print the case indices that would run, and stop")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take before it counts as hung")
    parser.add_argument(
        "--launch-every",
        type=int,
        default=3,
        help="check the real command (python train.py / torchrun) on every Nth refused case; 0: never (default 3)",
    )
    parser.add_argument("--cache-dir", default="~/.cache/trident", help="where the small dataset is cached")
    parser.add_argument(
        "--no-exits",
        action="store_true",
        help="skip the exit checks of trained models (consolidated, generation, init_from, Hugging Face)",
    )
    args = parser.parse_args()

    indices = args.case or list(range(args.cases))
    if args.cover:
        draw = functools.partial(draw_facts, REPO, args.seed, with_resume=True)
        with ProcessPoolExecutor(max(1, args.jobs), mp_context=multiprocessing.get_context("fork")) as pool:
            drawn = list(pool.map(draw, range(args.cover), chunksize=16))
        sample = cheapest_cover(drawn)
        indices = [d.case.index for d in sample]
        seconds = sum(estimated_seconds(d) for d in sample)
        trained = sum(d.layout is not None for d in sample)
        print(f"cover: {len(indices)} of the first {args.cover} cases ({trained} trained, ~{seconds:.0f} s idle)")
        for requirement in missing(drawn):
            print(f"    no case of them exercises {' with '.join(requirement)}")
    if args.dry_run:
        print(f"seed {args.seed}: cases {indices}")
        return 0

    # The rank pools fork their ranks from one server: it imports what every rank would otherwise import afresh
    # (each rank also re-runs this script's imports as its __mp_main__, and train.py's, torch.optim's dynamo, DCP):
    # 60% of a world-8 case's CPU before (case 330: 30 s).
    start_fork_server(RANK_PRELOAD)
    exits = (lambda case: False) if args.no_exits else (lambda case: True)
    fuzzer = Fuzzer(REPO, prepare_corpus(args.cache_dir), timeout_s=args.timeout, exits_of=exits)
    if not fuzzer.compiles:
        print("no C++ compiler found: the cases drawn with train.compile=true run eager (train.compile=false)")
    start = time.monotonic()
    results, refused, launches = [], 0, []
    for index in indices:
        case = draw_case(args.seed, index)
        check_launch = args.launch_every > 0 and (len(args.case or []) > 0 or refused % args.launch_every == 0)
        result = fuzzer.run_case(case, check_launch)
        refused += result.refused
        if result.launch_seconds is not None:
            launches.append(result.launch_seconds)
        results.append(result)
        verdict = "refused" if result.layout is None else f"trained as {result.layout.short()}"
        status = "ok" if result.passed else "FAIL"
        print(f"case {index}: {status} {verdict} ({result.seconds:.1f} s) {case.describe()}", flush=True)
        for problem in result.problems[:5]:
            print(f"    {problem}")
        if not result.passed:
            print(f"    reproduce: python tools/fuzz_layouts.py --seed {args.seed} --case {index}", flush=True)

    passed = sum(r.passed for r in results)
    elapsed = time.monotonic() - start
    launch = f", refused launches checked {len(launches)} (max {max(launches):.1f} s)" if launches else ""
    print(
        f"fuzz: {passed}/{len(results)} cases passed ({len(results) - refused} trained, {refused} refused{launch}) "
        f"in {elapsed:.0f} s, {elapsed / max(1, len(results)):.1f} s/case; seed {args.seed}"
    )
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

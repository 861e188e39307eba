"""Re-record the code and config hashes in dvc.lock, keeping every recorded output.

``dvc commit`` re-records a stage from its outputs, so it needs them in the work tree. A change that
cannot change any output (formatting, a docstring, a module moved without a change in behaviour)
only needs the hashes of the stage's code dependencies renewed. This does that, and nothing else:

    python tools/relock.py              # every recorded stage whose code or params hashes moved
    python tools/relock.py fedpad@quick # only these stages
    python tools/relock.py --check      # list them, write nothing (exit 1 if any)
    python tools/relock.py --params     # also re-record params whose values moved (a key renamed, say)

A dependency that is another stage's output (or a folder holding one) is left as recorded. Use it
only where outputs cannot change: a change that can must rebuild the stage (``dvc repro``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help="stage names (default: every recorded stage)")
    parser.add_argument("--check", action="store_true", help="list stale stages, write nothing")
    parser.add_argument(
        "--params",
        action="store_true",
        help="also re-record changed params (only where the change cannot change outputs)",
    )
    args = parser.parse_args(argv)

    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    recorded = set((yaml.safe_load((ROOT / "dvc.lock").read_text()) or {}).get("stages", {}))
    unknown = sorted(set(args.stages) - recorded)
    if unknown:
        raise SystemExit(
            f"not recorded in dvc.lock: {', '.join(unknown)}; recorded stages are listed by `dvc stage list`"
        )
    wanted = set(args.stages) or recorded
    renewed, moved_params = [], []
    with Repo(str(ROOT)) as repo:
        stages = list(repo.index.stages)
        outs = [Path(o.fs_path) for s in stages for o in s.outs]
        for stage in stages:
            if stage.name not in wanted:
                continue
            stale = False
            for dep in stage.deps:
                if not isinstance(dep, ParamsDependency):
                    path = Path(dep.fs_path)
                    if any(path == o or o in path.parents or path in o.parents for o in outs):
                        continue
                if any(dep.status().values()) or dep.hash_info is None or not dep.hash_info:
                    if isinstance(dep, ParamsDependency) and not args.params:
                        moved_params.append(f"{stage.name}: {', '.join(dep.status())}")
                        continue
                    stale = True
                    if not args.check:
                        dep.save()
            if stale:
                renewed.append(stage.name)
                if not args.check:
                    stage.dump(update_pipeline=False)
    if moved_params and not args.check:
        raise SystemExit(
            "params moved, which can change outputs; rebuild (`dvc repro`), or pass --params if the "
            "change cannot:\n  " + "\n  ".join(moved_params)
        )
    verb = "stale" if args.check else "re-recorded"
    print(f"{len(renewed)} stage(s) {verb}" + (f": {' '.join(sorted(renewed))}" if renewed else ""))
    return 1 if args.check and renewed else 0


if __name__ == "__main__":
    sys.exit(main())

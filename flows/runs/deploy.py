"""``infra/prefect.yaml``: one nightly deployment per registered system, written from the declarations.

    python -m flows.runs.deploy            # write infra/prefect.yaml
    python -m flows.runs.deploy --check    # exit 1 if the file differs from what the declarations say

Then, from the repository root, with a Prefect server (``PREFECT_API_URL``):

    prefect work-pool create fedcore-process --type process
    prefect deploy --all --prefect-file infra/prefect.yaml
    prefect worker start --pool fedcore-process
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from flows import systems

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"
PREFECT_VERSION = "3.9.1"

HEADER = """\
# Prefect deployments of the nightly federation runs: one per system, written by `python -m flows.runs.deploy`
# from the systems' declarations (flows/systems/); edit those, not this file. From the repository root:
#   prefect work-pool create fedcore-process --type process
#   prefect deploy --all --prefect-file infra/prefect.yaml
#   prefect worker start --pool fedcore-process
# With no `pull` section, Prefect records the directory `prefect deploy` ran in.
# After a successful run without overrides, each flow records its DVC stages (`dvc commit`) and pushes
# them to the DVC remote (flows/services/remote.py): the folder beside the checkout, unless the worker's environment
# sets FEDCORE_DVC_REMOTE. Commit the dvc.lock it leaves so that other clones can `make pull` that run.
# `push: false` turns sharing off.
"""


def render() -> str:
    """The file's text: the header, then every registered system's deployment (the plug-ins that
    conf/config.yaml names included), by name."""
    systems.configured_plugins()
    doc = {
        "name": "fedcore",
        "prefect-version": PREFECT_VERSION,
        "deployments": [s.deployment() for s in systems.all_systems()],
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flows.runs.deploy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PREFECT_FILE.is_file() or PREFECT_FILE.read_text() != text:
            print(
                f"{PREFECT_FILE.relative_to(ROOT)} differs from the systems' declarations; "
                "rewrite it with `python -m flows.runs.deploy`",
                file=sys.stderr,
            )
            return 1
        return 0
    PREFECT_FILE.write_text(text)
    print(f"wrote {len(systems.names())} deployments to {PREFECT_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The page ``dvc plots show`` writes, with Vega bundled in, so that it renders with no network.

DVC's default page loads Vega, Vega-Lite and Vega-Embed from a CDN, so offline (a cluster node, a
laptop on a plane, this project's CI) every plot is blank. This module writes ``.dvc/plots/page.html``
from the Vega-Embed bundle of the ``vl-convert-python`` package (Vega-Lite 5 and 6 specs, as DVC's
templates are) and points DVC at it in ``.dvc/config.local`` (``plots.html_template``; both are
ignored by git, so a clone without the page keeps DVC's own). ``make setup`` runs it; so can you:

    python -m flows.reports.plot_page          # writes .dvc/plots/page.html (about 0.9 MB) and sets the template

The page has no ``{scripts}`` placeholder, so DVC's CDN script tags are left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PAGE = Path(".dvc") / "plots" / "page.html"

TEMPLATE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>fedcore plots</title>
    <script type="text/javascript">
BUNDLE
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page() -> str:
    """The HTML template: DVC's, with the bundle where its CDN scripts were."""
    import vl_convert

    bundle = vl_convert.javascript_bundle()  # sets window.vegaEmbed, as DVC's plot divs call it
    if "</script" in bundle.lower() or "{plot_divs}" in bundle:
        raise RuntimeError("the Vega bundle cannot be inlined in a <script> element as it is")
    return TEMPLATE.replace("BUNDLE", bundle)


def write(root: Path, *, configure: bool = True) -> Path:
    """Write the page under ``root`` (a DVC repository) and, with ``configure``, point ``dvc plots show``
    at it in ``.dvc/config.local``; return its path."""
    path = Path(root) / PAGE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(), encoding="utf-8")
    if configure:
        subprocess.run(
            [sys.executable, "-m", "dvc", "config", "--local", "plots.html_template", "plots/page.html"],
            cwd=root,
            check=True,
            capture_output=True,
        )
    return path


if __name__ == "__main__":
    print(f"wrote {write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path('.'))}")

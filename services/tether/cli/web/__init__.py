"""`tether ui`: a small web view of one run, served from the package with no internet needed (plain HTML,
one stylesheet and one script under static/, inline SVG charts).

    store   what the pages show, read through the same readers as `tether traces`, `samples` and
            `metrics` (tether.cli.inspection) and the run directory's metrics.jsonl
    tokens  a sample's tokens classified (trained, context, masked tool output, grammar-masked): pure
    svg     line charts as inline SVG: pure
    pages   the HTML of each page from records: pure, every value escaped
    app     the Starlette app: routes, the admin token, the static files

Imported only by `tether ui` (tether.cli.ui), when it runs.
"""

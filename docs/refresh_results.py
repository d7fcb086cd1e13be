"""Rewrites the seed comparisons (``variants``) of a study's ``results.json`` from the
per-seed values it stores (``runs``), with today's lexjax.reports: a study run before
a comparison existed gains it without its runs being evaluated again.

    python docs/refresh_results.py docs/results docs/results_text ...

Only ``variants`` changes; the tables and figures beside it are left as they are.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lexjax import reports


def refresh(directory: str) -> None:
    path = os.path.join(directory, "results.json")
    results = reports.read_json(path)
    results["variants"] = reports.variant_stats(results["runs"], results["lengths"])
    reports.write_json(path, results)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python docs/refresh_results.py STUDY_DIR ...")
    for directory in sys.argv[1:]:
        if not os.path.isfile(os.path.join(directory, "results.json")):
            sys.exit(f"error: {directory} holds no results.json")
        refresh(directory)
        print(f"refreshed {os.path.join(directory, 'results.json')}")

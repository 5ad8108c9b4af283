"""Every attack against every defence: what they cost FedAvg, FedRep, Ditto and pFLAlign, and which
defence can be the default.

For each scenario (``--scenarios``: configs/scenarios/NAME.toml), each attacker share
(``--attackers``) and each attack (``--attacks``), one ``simulate.py`` study over ``--seeds`` runs
every method of ``--methods`` under every defence of ``--defences`` as its own method entry
(``fedavg(aggregation=krum)``, ...; ``update-clip`` is ``update-clip = 1`` on the mean; ``mean``
is the project's default: the mean with the update-norm bound). One more study per scenario runs
the same entries without attackers: the reference of each attack's change and of each defence's
honest cost. Every study is kept in ``OUT`` (a finished one is read back, one killed part-way
continues), so the grid can be run in parts (``--scenarios``, ``--attacks``, ...) and read back
whole.

Measured per (scenario, attackers, attack, method, defence), over the seeds, on the **honest**
clients only (the attackers are drawn from the seed; their own test sets are left out, so that
an attack cannot move the figure by its own clients): the final personal accuracy and its worst
decile (the mean of the worst ceil(10%) honest clients) against the attacker-free run of the same
entry and seed (the change, paired by seed, with its 95% t-interval); under ``backdoor`` the
trigger's success rate on the honest clients' test splits. Per defence: its honest cost (its
attacker-free accuracy against the default's, paired by seed) and the seconds it adds to a round
(its rows' ``defence-seconds``; FLTrust's include its root training).

The recommended default is a defence whose honest cost lies within its seeds' noise (the
interval holds 0) for every method and scenario, and that keeps every attack's mean change within
5 points at the largest attacker share; the report says which one, or that none does and which
attack breaks which defence.

    python benchmarks/attacks.py
    python benchmarks/attacks.py --scenarios dir-0.1 --attackers 0.2 \\
        --attacks alie,ipm --seeds 0,1,2      # one part of the grid
    python benchmarks/attacks.py --jobs 2 --runs-only   # two at a time, no report

The default ``--out`` is ``docs/experiments/attacks/grid``, whose studies' ``plan.json`` and
seeds' ``results.json.gz`` git keeps (.gitignore): ``--pack`` writes each seed's
``results.json`` compressed beside it (about a tenth of its size; a cross-device seed's
``results.json`` is some 2 MB), and every start unpacks a ``results.json.gz`` whose
``results.json`` is missing. Packed and committed as they finish, the grid continues from a
fresh clone over several sessions (a seed's ``results.json`` is written after each method
entry, so a commit loses at most the entry under way).

``--jobs N`` runs N studies at a time, each a process with one torch thread (the default
``client-resources-num-cpus = 1``); ``--runs-only`` stops before the report.
"""

from __future__ import annotations

import argparse
import gzip
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from studies import cached_study

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pflalign.engines.faults import malicious_clients  # noqa: E402
from pflalign.outputs.report import study_runs  # noqa: E402
from pflalign.outputs.stats import mean_ci  # noqa: E402
from pflalign.run.config import build_settings, defaults, method_labels, resolve  # noqa: E402
from pflalign.server.metrics import accuracy_summary  # noqa: E402

ATTACKS = "alie,ipm,min-max,min-sum,labelflip,signflip,scale,backdoor,free-rider"
DEFENCES = "mean,median,trimmed-mean,krum,multi-krum,bulyan,centered-clip,fltrust,update-clip"
#: a point of accuracy, as a fraction
POINT = 0.01


def entry(method: str, defence: str, label: bool = False) -> str:
    """The method entry of ``method`` under ``defence``; ``label``: as simulate.py labels it in
    its results (the project's own parser: string values quoted, numbers as typed values)."""
    if defence == "mean":
        text = method
    elif defence == "update-clip":
        text = f"{method}(update-clip=1)"
    else:
        text = f"{method}(aggregation={defence})"
    return method_labels({**defaults(), "methods": text})[0] if label else text


def honest_figures(entry_result: dict, attackers: frozenset[int]) -> dict[str, float]:
    """The honest clients' final personal accuracy, its worst decile and, under a backdoor,
    the trigger's success on their test splits (pooled over their non-target samples)."""
    clients = [c for c in entry_result.get("clients", []) if c["id"] not in attackers
               and not c.get("unseen")]
    if not clients:
        return {}
    summary = accuracy_summary([c["personal-acc"] * c["num-test"] for c in clients],
                               [c["num-test"] for c in clients])
    figures = {"acc": summary["personal-acc"], "worst": summary["personal-acc-bottom10"]}
    asr = [c["personal-backdoor-asr"] for c in clients if "personal-backdoor-asr" in c]
    if asr:
        figures["asr"] = float(sum(asr) / len(asr))
    seconds = [r.get("defence-seconds") for r in entry_result.get("rounds", [])
               if "defence-seconds" in r]
    figures["seconds"] = float(sum(seconds) / len(seconds)) if seconds else 0.0
    return figures


def study_figures(doc: dict, base: dict, changes: dict) -> dict[str, dict[int, dict]]:
    """label -> seed -> :func:`honest_figures` of a study's runs."""
    out: dict[str, dict[int, dict]] = {}
    for run in study_runs(doc):
        seed = int(run["seed"])
        attackers = (malicious_clients(build_settings({**base, **changes, "seed": seed}))
                     if changes else frozenset())
        for label, result in run["methods"].items():
            out.setdefault(label, {})[seed] = honest_figures(result, attackers)
    return out


def interval(values: list[float], points: bool = True) -> str:
    mean, low, high, n = mean_ci(values)
    if n == 0:
        return "none"
    scale = 100 if points else 1
    if n == 1 or math.isnan(low):
        return f"{scale * mean:.2f}"
    return f"{scale * mean:.2f} [{scale * low:.2f}, {scale * high:.2f}]"


def paired(attacked: dict[int, dict], clean: dict[int, dict], key: str) -> list[float]:
    return [attacked[s][key] - clean[s][key] for s in sorted(attacked)
            if s in clean and key in attacked[s] and key in clean[s]]


def seed_results(out: Path, suffix: str) -> list[Path]:
    return sorted(out.glob(f"*/*/runs/*/seed-*/results.json{suffix}"))


def pack(out: Path) -> int:
    """Write each seed's ``results.json`` gzip-compressed beside it (``mtime`` 0, so that an
    unchanged file packs to the same bytes); returns how many changed."""
    changed = 0
    for path in seed_results(out, ""):
        packed = gzip.compress(path.read_bytes(), compresslevel=9, mtime=0)
        target = path.with_name("results.json.gz")
        if not target.exists() or target.read_bytes() != packed:
            target.write_bytes(packed)
            changed += 1
    return changed


def unpack(out: Path) -> int:
    """``results.json`` from each ``results.json.gz`` that has none (a fresh clone)."""
    count = 0
    for path in seed_results(out, ".gz"):
        if not (plain := path.with_name("results.json")).exists():
            plain.write_bytes(gzip.decompress(path.read_bytes()))
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/experiments/attacks/grid")
    parser.add_argument("--scenarios", default="dir-0.1,cross-device")
    parser.add_argument("--methods", default="fedavg,fedrep,ditto,pflalign")
    parser.add_argument("--attacks", default=ATTACKS)
    parser.add_argument("--defences", default=DEFENCES)
    parser.add_argument("--attackers", default="0.1,0.2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engine", default="batched")
    parser.add_argument("--set", action="append", default=[],
                        help="KEY=VALUE for every study (e.g. rounds=10)")
    parser.add_argument("--jobs", type=int, default=1, help="studies at a time (processes)")
    parser.add_argument("--pack", action="store_true",
                        help="compress each seed's results.json in OUT beside it, and stop")
    parser.add_argument("--runs-only", action="store_true",
                        help="run (or read back) the studies, and stop before the report")
    args = parser.parse_args()
    out = Path(args.out)
    if args.pack:
        print(f"packed {pack(out)} seeds' results.json in {out}")
        return
    if unpacked := unpack(out):
        print(f"unpacked {unpacked} seeds' results.json.gz in {out}")
    methods, defences = args.methods.split(","), args.defences.split(",")
    attacks, shares = args.attacks.split(","), [float(a) for a in args.attackers.split(",")]
    entries = ",".join(entry(m, d) for m in methods for d in defences)
    lines = [f"Command: `python benchmarks/attacks.py --out {args.out} --scenarios "
             f"{args.scenarios} --methods {args.methods} --attacks {args.attacks} --defences "
             f"{args.defences} --attackers {args.attackers} --seeds {args.seeds} --engine "
             f"{args.engine}" + "".join(f" --set {s}" for s in args.set) + "`", ""]
    verdicts: dict[str, dict] = {d: {"cost": [], "broken": []} for d in defences}

    def common(scenario: str) -> list[str]:
        return ["--config", str(ROOT / "configs" / "scenarios" / f"{scenario}.toml"),
                "--methods", entries, "--seeds", args.seeds, "--set", f"engine={args.engine}",
                "--set", "save-models=none",
                *[flag for item in args.set for flag in ("--set", item)]]

    def attacked(scenario: str, attack: str, share: float) -> tuple[Path, list[str], str]:
        return (out / scenario / f"{attack}-{share:g}",
                [*common(scenario), "--set", f"attackers={share:g}", "--set",
                 f"attack={attack}"], f"{scenario} / {attack} / {share:g}")

    # every study first, --jobs at a time: the clean ones, then each share's from the largest
    # (the verdict's) down, each scenario in turn; then the report, which reads them back
    scenarios = args.scenarios.split(",")
    studies = [(out / scenario / "clean", common(scenario), f"{scenario} / clean")
               for scenario in scenarios] + [
        attacked(scenario, attack, share) for share in sorted(shares, reverse=True)
        for scenario in scenarios for attack in attacks]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda spec: cached_study(*spec), studies))
    if args.runs_only:
        return
    for scenario in args.scenarios.split(","):
        config = ROOT / "configs" / "scenarios" / f"{scenario}.toml"
        base = dict(resolve(config, args.set).to_dict())
        clean = study_figures(cached_study(out / scenario / "clean", common(scenario),
                                           f"{scenario} / clean"), base, {})
        lines += [f"## {scenario}", "", "### Without attackers: each defence's honest cost", "",
                  "Honest clients' final personal accuracy (%, mean [95% t-interval over "
                  "seeds]), its change from the default (`mean`) paired by seed, and the "
                  "defence's seconds per round:", "",
                  "| method | defence | accuracy | honest cost | worst decile | s/round |",
                  "|---|---|---:|---:|---:|---:|"]
        for method in methods:
            default = clean.get(entry(method, "mean", True), {})
            for defence in defences:
                figures = clean.get(entry(method, defence, True), {})
                cost = paired(figures, default, "acc")
                if defence != "mean":
                    verdicts[defence]["cost"].append((scenario, method, cost))
                lines.append(
                    f"| {method} | {defence} | "
                    f"{interval([f['acc'] for f in figures.values() if 'acc' in f])} | "
                    f"{interval(cost) if defence != 'mean' else '-'} | "
                    f"{interval([f['worst'] for f in figures.values() if 'worst' in f])} | "
                    f"{interval([f['seconds'] for f in figures.values()], points=False)} |")
        lines.append("")
        for share in shares:
            lines += [f"### {share:.0%} attackers", "",
                      "Change of the honest clients' final personal accuracy from the "
                      "attacker-free run of the same entry (points, mean [95% t-interval], "
                      "paired by seed); under backdoor its success rate (%) instead; the worst "
                      "decile's change below each:", "",
                      "| method | defence | " + " | ".join(attacks) + " |",
                      "|---|---|" + "---:|" * len(attacks)]
            results = {}
            for attack in attacks:
                changes = {"attackers": share, "attack": attack}
                results[attack] = study_figures(
                    cached_study(*attacked(scenario, attack, share)), base, changes)
            for method in methods:
                for defence in defences:
                    label = entry(method, defence, True)
                    cells, worst = [], []
                    for attack in attacks:
                        attacked = results[attack].get(label, {})
                        change = paired(attacked, clean.get(label, {}), "acc")
                        if attack == "backdoor":
                            cells.append("ASR " + interval([f["asr"] for f in attacked.values()
                                                            if "asr" in f]))
                        else:
                            cells.append(interval(change))
                        worst.append(interval(paired(attacked, clean.get(label, {}), "worst")))
                        if share == max(shares) and change and (
                                sum(change) / len(change) < -5 * POINT):
                            verdicts[defence]["broken"].append(
                                (scenario, method, attack, sum(change) / len(change)))
                    lines.append(f"| {method} | {defence} | " + " | ".join(cells) + " |")
                    lines.append("| | worst decile | " + " | ".join(worst) + " |")
            lines.append("")
    lines += ["## Verdict", ""]
    free = []
    for defence in defences:
        if defence == "mean":
            continue
        costly = [(s, m) for s, m, cost in verdicts[defence]["cost"]
                  if len(cost) > 1 and not _holds_zero(cost)]
        broken = verdicts[defence]["broken"]
        if not costly and not broken:
            free.append(defence)
        lines.append(f"- `{defence}`: honest cost "
                     + ("within the seeds' noise everywhere" if not costly else
                        "outside the noise for " + ", ".join(f"{m} on {s}" for s, m in costly))
                     + "; " + ("every attack within 5 points" if not broken else
                               "broken by " + ", ".join(
                                   f"{a} ({m}, {s}: {100 * c:.1f})" for s, m, a, c in broken)))
    lines += ["", "Recommended default: " + (f"`{free[0]}`" if free else
                                             "none meets both conditions."), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "attacks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _holds_zero(values: list[float]) -> bool:
    _, low, high, _ = mean_ci(values)
    return not (low > 0 or high < 0)


if __name__ == "__main__":
    main()

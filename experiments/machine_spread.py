"""The spread between machines (issue 47 item 7): where two runs of the same headline diverge.

The headline (``bundles/nlst_focal.json``) run once per **arm**, each a subprocess whose environment
emulates another machine by one change of the CPU kernels it dispatches:

* ``base``: this machine as it is (the variables below removed from the environment: torch's own
  thread count, the widest ISA ATen, oneDNN and MKL find);
* ``repeat``: ``base`` again (is one machine deterministic at all?);
* ``aten_avx2``: ``ATEN_CPU_CAPABILITY=avx2`` (ATen's vectorised kernels of an AVX2 machine);
* ``onednn_avx2``: ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's convolutions of an AVX2 machine);
* ``mkl_cbwr``: ``MKL_CBWR=COMPATIBLE`` (MKL's conditional numerical reproducibility, its portable path);
* ``threads1``: ``OMP_NUM_THREADS=1`` (one intra-op thread: another reduction order);
* ``pinned`` (``--pinned``): all four at once, the portable path a default could pin; its seconds
  per epoch against ``base`` and ``threads1`` are the cost of pinning;
* ``t1_onednn_avx2``, ``t1_mkl_cbwr``: one thread and one ISA change (against ``threads1`` with
  ``--reference threads1``: the ISA's share when the thread count is pinned).

Every arm trains on the same bags (``<out>/<arm>/cache`` links to ``<out>/shared/cache``, built once by
the first arm), so a difference in the weights is the training's. Whether the bags themselves depend on
the arm is checked apart: each arm builds the bags of the first ``--bag-rows`` CTs of the datalist again,
in-process (``num_workers=0``, so the arm's threads and ISA apply), into ``<out>/bagcheck/<arm>``, and
hashes their arrays.

Columns: the bag hash (those rebuilt bags), the weights hash (``last.pt``'s state dict; ``best.pt``'s is
in the JSON), the first epoch whose mean ``train/loss`` differs from the reference arm's (``--reference``,
``base``), the largest difference of a test probability (before TS, the run's predictions CSV, 6 decimals)
from the reference's, the test AUC, ECE (10 bins, after TS) and T the run printed, and seconds per epoch
(from the MLflow timestamps of ``train/loss``, validation included, on a machine shared with other jobs:
an indication, not a benchmark).

    lungcal synth --out runs/spread/cohort --n 150 --seed 3 --formats nii
    python -m monai.bundle run --config_file bundles/nlst_focal.json --datalist runs/spread/cohort/datalist.json \
        --epochs 1 --output_dir runs/spread/shared --tracking_uri sqlite:///runs/spread/shared.db \
        --n_bootstrap 20 --test_pictures none --num_workers 2      # the shared bags, once (any arm would build them)
    python experiments/machine_spread.py --datalist runs/spread/cohort/datalist.json --out runs/spread \
        --epochs 20 --arms base repeat threads1 aten_avx2 onednn_avx2 mkl_cbwr --pinned --bag-rows 4
    python experiments/machine_spread.py --ops --arms repeat threads1 aten_avx2 onednn_avx2 mkl_cbwr --pinned \
        --out runs/spread                                   # which op parts first (one step per arm)
    python experiments/machine_spread.py --ops --arms threads1 pinned --rounds 3 --out runs/spread/timing
    python experiments/machine_spread.py --datalist runs/spread/cohort/datalist.json --out runs/spread120 \
        --shared-cache runs/spread/shared/cache --epochs 120 --reference threads1 --bag-rows 0 \
        --arms threads1 pinned t1_onednn_avx2 t1_mkl_cbwr   # the headline's 120 epochs, one-thread arms
    python experiments/machine_spread.py --out runs/spread --table     # the table again, nothing run

Each arm's stdout goes to ``<out>/<arm>.log`` and its row to ``<out>/spread.json`` (an arm already
there is not run again unless ``--force``).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from lungcal.ctapp.model.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
         "OMP_NUM_THREADS", "MKL_NUM_THREADS")
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE",
          "OMP_NUM_THREADS": "1"}
ARMS: dict[str, dict[str, str]] = {
    "base": {},
    "repeat": {},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl_cbwr": {"MKL_CBWR": "COMPATIBLE"},
    "threads1": {"OMP_NUM_THREADS": "1"},
    "pinned": PINNED,
    "t1_onednn_avx2": {"OMP_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "t1_mkl_cbwr": {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"},
}

BAG_CHECK = r"""
import hashlib, json, sys
import torch
from lungcal.candidates.cache import build_bags, load_bag
from lungcal.data.manifest import load_manifest
from lungcal.ctapp.model.checkpoint import bag_params_of, load_checkpoint
ck = load_checkpoint(sys.argv[1])
rows = load_manifest(sys.argv[2])[: int(sys.argv[4])]
built = build_bags(rows, bag_params_of(ck), sys.argv[3], num_workers=0, progress=False)
h = hashlib.sha256()
for e in built:
    bag = load_bag(e["bag"])
    for k in sorted(bag):
        if k != "meta":
            h.update(k.encode()); h.update(bag[k].tobytes())
print(json.dumps({"bag_hash": h.hexdigest()[:12], "threads": torch.get_num_threads(),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""

OPS = r"""
import hashlib, json, time
import numpy as np
import torch
from lungcal.mil import LogSumExpMIL, SmallCNNEncoder
torch.manual_seed(0)
net = LogSumExpMIL(SmallCNNEncoder(embed_dim=64), attn_dim=64, dropout=0.0).train()
rng = np.random.default_rng(0)
bags = torch.from_numpy(rng.standard_normal((16, 16, 1, 16, 16, 16), dtype=np.float32))
mask = torch.ones(16, 16, dtype=torch.bool)
h = lambda t: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:12]
outs, hooks = {}, []
for name, m in net.named_modules():
    if not list(m.children()):
        hooks.append(m.register_forward_hook(
            lambda mod, i, o, name=name: outs.__setitem__(name, h(o if torch.is_tensor(o) else o[0]))))
logits, _ = net(bags, mask)
logits[:, 1].sum().backward()
for hook in hooks:
    hook.remove()
grads = {n: h(p.grad) for n, p in net.named_parameters() if p.grad is not None}
times = []
for _ in range(7):  # the step's time: forward and backward of the same batch, median of 7
    t0 = time.perf_counter()
    net.zero_grad()
    net(bags, mask)[0][:, 1].sum().backward()
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_ms": round(1000 * sorted(times)[3], 1), "threads": torch.get_num_threads(),
                  "capability": torch.backends.cpu.get_cpu_capability(),
                  "outputs": outs, "logits": h(logits), "grads": grads}))
"""


def arm_env(changes: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update(changes)
    return env


def weights_hash(path: Path) -> str:
    sd = load_checkpoint(path)["state_dict"]
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def parse_headline(text: str) -> dict[str, float | str | None]:
    """Test AUC, ECE after TS and T from the run's printed summary, and its stage-1 run id."""
    def first(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    run = re.findall(r"([0-9a-f]{32}) \(stage 1\)", text)
    return {"run_id": run[0] if run else None,
            "auc": first(r"\+TS\s+test AUC ([0-9.]+)"),
            "ece": first(r"\+TS\s+test AUC [^\n]*?ECE ([0-9.]+)"),
            "T": first(r"\n\s*temperature\s+([0-9.]+)")}


def loss_history(uri: str, run_id: str) -> list[tuple[int, float, int]]:
    hist = MlflowClient(uri).get_metric_history(run_id, "train/loss")
    return sorted((m.step, m.value, m.timestamp) for m in hist)


def run_arm(name: str, args) -> dict:
    out = args.out.absolute()
    arm_dir = out / name
    arm_dir.mkdir(parents=True, exist_ok=True)
    shared = (args.shared_cache or out / "shared" / "cache").absolute()
    shared.mkdir(parents=True, exist_ok=True)
    link = arm_dir / "cache"
    if not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    env = arm_env(ARMS[name])
    uri = f"sqlite:///{out / (name + '.db')}"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_focal.json",
           "--datalist", str(args.datalist.absolute()), "--epochs", str(args.epochs), "--output_dir", str(arm_dir),
           "--tracking_uri", uri, "--n_bootstrap", str(args.n_bootstrap), "--test_pictures", "none",
           "--num_workers", str(args.workers)]
    print(f"[{name}] {' '.join(f'{k}={v}' for k, v in ARMS[name].items())} {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    (out / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed ({proc.returncode}); see {out / (name + '.log')}")
    row = {"arm": name, "env": ARMS[name], "wall_s": round(wall, 1), **parse_headline(proc.stdout + proc.stderr)}
    lasts = sorted(arm_dir.rglob("last.pt"), key=lambda p: p.stat().st_mtime)
    bests = sorted(arm_dir.rglob("best.pt"), key=lambda p: p.stat().st_mtime)
    row["weights_last"] = weights_hash(lasts[-1]) if lasts else None
    row["weights_best"] = weights_hash(bests[-1]) if bests else None
    if row["run_id"]:
        hist = loss_history(uri, row["run_id"])
        row["loss"] = [v for _, v, _ in hist]
        if len(hist) > 1:
            row["s_per_epoch"] = round((hist[-1][2] - hist[0][2]) / 1000 / (len(hist) - 1), 2)
    row["p_test"] = test_probs(out, row["run_id"])
    if args.bag_rows > 0 and lasts:
        check = subprocess.run([sys.executable, "-c", BAG_CHECK, str(lasts[-1]), str(args.datalist.absolute()),
                                str(out / "bagcheck" / name), str(args.bag_rows)],
                               cwd=ROOT, env=env, capture_output=True, text=True)
        if check.returncode != 0:
            print(check.stderr[-2000:], flush=True)
        else:
            row.update(json.loads(check.stdout.strip().splitlines()[-1]))
    return row


def test_probs(out: Path, run_id: str | None) -> list[float] | None:
    """The run's test probabilities (before TS, in the datalist's order) from its MLflow artifact."""
    if not run_id:
        return None
    path = out / "mlartifacts" / run_id / "artifacts" / "predictions" / "test_predictions.csv"
    if not path.is_file():
        return None
    with path.open() as f:
        return [float(r["probability"]) for r in csv.DictReader(f)]


def first_divergence(row: dict, base: dict | None) -> str:
    """The first epoch whose mean train loss differs from the reference arm's, and by how much."""
    if base is None or not row.get("loss") or not base.get("loss"):
        return "-"
    for i, (a, b) in enumerate(zip(row["loss"], base["loss"])):
        if a != b:
            return f"{i + 1} (Δ {a - b:+.1e})"
    return "none"


def table(rows: dict[str, dict], reference: str = "base") -> str:
    base = rows.get(reference)
    lines = [f"| arm | env | threads / ISA | bag hash | weights hash (last.pt) | first epoch off {reference} | "
             f"max \\|Δp\\| test vs {reference} | test AUC | ECE (TS) | T | s / epoch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        dp = "-"
        if base and r.get("p_test") and base.get("p_test") and len(r["p_test"]) == len(base["p_test"]):
            d = max(abs(a - b) for a, b in zip(r["p_test"], base["p_test"]))
            dp = f"{d:.1e}" if d else ("0" if r.get("weights_last") == base.get("weights_last") else "< 1e-6")
        env = ", ".join(f"`{k}={v}`" for k, v in r["env"].items()) or "as found"
        lines.append(f"| {name} | {env} | {r.get('threads', '?')} / {r.get('capability', '?')} | "
                     f"`{r.get('bag_hash', '-')}` | `{r.get('weights_last')}` | {first_divergence(r, base)} | {dp} | "
                     f"{r.get('auc')} | {r.get('ece')} | {r.get('T')} | {r.get('s_per_epoch', '-')} |")
    return "\n".join(lines)


def ops(arms: list[str], out: Path, rounds: int = 1) -> str:
    """One training step's forward outputs (per leaf module) and gradients (per parameter) in each arm's
    environment, on the same random bags and initial weights: the first module whose output differs from
    ``base`` is where the arm's kernels part from this machine's. The arms run ``rounds`` times in turn
    (ABC ABC ...), so that a load that drifts falls on all of them; ms / step is the median over the rounds
    of each run's median of 7 steps (forward and backward, 16 bags of 16 patches)."""
    found: dict[str, dict] = {}
    for _ in range(rounds):
        for name in arms:
            r = subprocess.run([sys.executable, "-c", OPS], cwd=ROOT, env=arm_env(ARMS[name]),
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-2000:])
            f = json.loads(r.stdout.strip().splitlines()[-1])
            if name in found and (f["outputs"], f["grads"]) != (found[name]["outputs"], found[name]["grads"]):
                raise SystemExit(f"{name}: a second run of one arm gave other bits")
            f["step_runs"] = found.get(name, {}).get("step_runs", []) + [f["step_ms"]]
            found[name] = f
    (out / "ops.json").write_text(json.dumps(found, indent=1))
    base = found["base"]
    lines = ["| arm | threads / ISA | forward: modules whose output differs from base (first) | logits | "
             "gradients differing | ms / step (runs) |", "|---|---|---|---|---|---|"]
    for name, f in found.items():
        diff = [m for m in base["outputs"] if f["outputs"].get(m) != base["outputs"][m]]
        grads = [g for g in base["grads"] if f["grads"].get(g) != base["grads"][g]]
        first = f"{len(diff)} of {len(base['outputs'])} (`{diff[0]}`)" if diff else "none"
        same = "same" if f["logits"] == base["logits"] else "differ"
        runs = sorted(f["step_runs"])
        lines.append(f"| {name} | {f['threads']} / {f['capability']} | {first} | {same} | "
                     f"{len(grads)} of {len(base['grads'])} | {runs[len(runs) // 2]:.0f} "
                     f"({', '.join(f'{x:.0f}' for x in f['step_runs'])}) |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datalist", type=Path)
    p.add_argument("--out", type=Path, default=Path("runs/spread"))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--arms", nargs="+", default=["base", "repeat", "aten_avx2", "onednn_avx2", "mkl_cbwr", "threads1"],
                   choices=list(ARMS))
    p.add_argument("--pinned", action="store_true", help="add the pinned arm (all four changes at once)")
    p.add_argument("--n-bootstrap", type=int, default=50, 
                   help="the run's CI resamples (the point values do not use them)")
    p.add_argument("--workers", type=int, default=2, help="bag workers of the first (building) arm")
    p.add_argument("--bag-rows", type=int, default=8, help="CTs whose bags each arm rebuilds and hashes (0: none)")
    p.add_argument("--force", action="store_true", help="run an arm again even if spread.json has it")
    p.add_argument("--table", action="store_true", help="print the table of spread.json and stop")
    p.add_argument("--ops", action="store_true", help="only the one-step locator of --arms (base first): which "
                   "module's output and which gradients differ; nothing trained")
    p.add_argument("--reference", default="base", choices=list(ARMS), help="the arm the others are compared to")
    p.add_argument("--shared-cache", type=Path, help="the bag and QC cache the arms share (default <out>/shared/cache)")
    p.add_argument("--rounds", type=int, default=1, help="--ops: run the arms this many times in turn")
    args = p.parse_args()
    if args.ops:
        args.out.mkdir(parents=True, exist_ok=True)
        arms = list(dict.fromkeys(["base", *args.arms] + (["pinned"] if args.pinned else [])))
        print(ops(arms, args.out, args.rounds))
        return
    store = args.out / "spread.json"
    rows: dict[str, dict] = json.loads(store.read_text()) if store.is_file() else {}
    for r in rows.values():  # rows written before the probabilities were kept
        if "p_test" not in r:
            r["p_test"] = test_probs(args.out.absolute(), r.get("run_id"))
    if not args.table:
        if args.datalist is None:
            p.error("--datalist is required unless --table")
        arms = list(dict.fromkeys(args.arms + (["pinned"] if args.pinned else [])))
        for name in arms:
            if name in rows and not args.force:
                continue
            rows[name] = run_arm(name, args)
            store.write_text(json.dumps(rows, indent=1))
            print(table(rows, args.reference), flush=True)
    print(table(rows, args.reference))


if __name__ == "__main__":
    main()

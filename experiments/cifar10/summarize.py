"""Collect the final test errors of CIFAR10 runs into a table.

    python -m experiments.cifar10.summarize [--runs out/cifar10] [--out docs/results/cifar10.md]

Reads RUNS/<name>/checkpoint.pt (for the settings) and RUNS/<name>/log.csv of every run below
RUNS and prints one row per run: recipe, data, epochs done of those planned, the last epoch's test
error and, for SWALP, the averaged model's. Only finished runs of a recipe's own configuration
(its epochs, batch size, learning rate and averaging start, the published network's width, one
process) on the verified CIFAR10 release are marked as results for the README's lpsim column; runs
on fake data, on unverified data, not yet finished, or with other settings (a shorter schedule,
another learning rate, epochs added by --resume, several processes under torchrun) are listed with
the reason they are not.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

import torch

from experiments.cifar10.recipes import RECIPES
from experiments.cifar10.train import CHECKPOINT, LOG

__all__ = ["departures", "collect", "markdown", "main"]


def departures(config: dict) -> list[str]:
    """The settings of a run (its checkpoint's config) that differ from its recipe's own, as
    "name value (recipe: value)", and training in several processes, which is another
    simulation than the recipe's one process (CifarRecipe.multi_process says how); empty for a
    run of the recipe as published."""
    recipe = RECIPES.get(config["recipe"])
    if recipe is None:
        return [f"recipe {config['recipe']} (unknown)"]
    schedule = config.get("schedule_epochs", config["epochs"])
    own = {
        "epochs": (config["epochs"], recipe.epochs),
        "schedule epochs": (schedule, recipe.epochs),
        "batch size": (config["batch_size"], recipe.batch_size),
        "lr": (config["lr"], recipe.lr),
        "swa start": (config["swa_start"], recipe.default_swa_start(recipe.epochs)),
        "width": (config["width"], 1.0),
    }
    found = [
        f"{name} {mine} (recipe: {theirs})"
        for name, (mine, theirs) in own.items()
        if mine != theirs
    ]
    processes = config.get("world_size", 1)
    if processes > 1:
        found.append(f"{processes} processes: {recipe.multi_process}")
    return found


def collect(runs: pathlib.Path) -> list[dict]:
    """One dict per run directory below ``runs`` holding a checkpoint and a log, sorted by name."""
    rows = []
    for folder in sorted(p.parent for p in runs.glob(f"*/{CHECKPOINT}")):
        if not (folder / LOG).is_file():
            continue
        config = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True)["config"]
        with open(folder / LOG, newline="") as f:
            log = list(csv.DictReader(f))
        last = log[-1] if log else {}
        done, planned = len(log), config["epochs"]
        if config["data"] != "cifar10":
            status = f"not a result: data {config['data']}"
        elif done < planned:
            status = "not a result: unfinished"
        elif departures(config):
            status = "not a result: " + ", ".join(departures(config))
        else:
            status = "result"
        rows.append(
            {
                "run": folder.name,
                "recipe": config["recipe"],
                "data": config["data"],
                "epochs": f"{done}/{planned}",
                "test_error": last.get("test_error", ""),
                "swa_test_error": last.get("swa_test_error", ""),
                "status": status,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| run | recipe | data | epochs | test error % | averaged test error % | status |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['recipe']} | {r['data']} | {r['epochs']} | "
            f"{r['test_error'] or '-'} | {r['swa_test_error'] or '-'} | {r['status']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python -m experiments.cifar10.summarize", description=__doc__.splitlines()[0]
    )
    p.add_argument("--runs", type=pathlib.Path, default=pathlib.Path("out") / "cifar10")
    p.add_argument("--out", type=pathlib.Path, help="also write the table to this file")
    args = p.parse_args(argv)
    rows = collect(args.runs)
    if not rows:
        p.error(f"no runs (a checkpoint and a log) below {args.runs}")
    text = markdown(rows)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()

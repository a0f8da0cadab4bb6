"""Read the adahop plan out of a torchtitan DCP checkpoint, with no model built.

    python check_dcp.py CHECKPOINT_FOLDER_OR_STEP_DIR [--plan adahop_plan.json]

Lists the checkpoint's steps, loads every ``*._extra_state`` tensor (each AdaHOP layer's plan
and calibration votes, ``adahop.nn.state``) and ``train_state.step`` from the latest one, prints
the plan table, and with ``--plan`` checks it equals the plan the run saved when it froze. Exit
status 1 when a layer has no frozen plan or the plans differ.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from adahop.nn.state import decode_state
from adahop.policy import ModelPlan


def step_dirs(folder: Path) -> list[Path]:
    steps = [p for p in folder.iterdir() if re.fullmatch(r"step-\d+", p.name)] if folder.is_dir() else []
    return sorted(steps, key=lambda p: int(p.name.split("-")[1]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--plan", type=Path, help="adahop_plan.json to compare with")
    args = parser.parse_args()
    steps = step_dirs(args.path)
    if steps:
        print(f"checkpoints in {args.path}: {', '.join(p.name for p in steps)}")
    path = steps[-1] if steps else args.path
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    extra = sorted(k for k in metadata if k.endswith("._extra_state"))
    state = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in extra}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
        if "train_state.step" in metadata:  # a non-tensor item: DCP replaces the value
            step = {"train_state.step": 0}
            dcp.load(step, checkpoint_id=path)
            print(f"{path.name}: train_state.step = {step['train_state.step']}")
    print(f"{path.name}: {len(metadata)} items, {len(extra)} AdaHOP layer states (_extra_state)")
    plans, calibrating = {}, []
    for key in extra:
        plan, votes = decode_state(state[key])
        name = key.removesuffix("._extra_state")
        if plan is None:
            calibrating.append(name)
        else:
            plans[name] = plan
    plan = ModelPlan(plans)
    print(f"{len(plans)} layers with a frozen plan, {len(calibrating)} still calibrating")
    if plans:
        print(plan.summary())
    status = 0 if plans and not calibrating else 1
    if args.plan is not None:
        saved = ModelPlan.load(args.plan)
        same = dict(saved) == dict(plan)
        print(f"plan in the checkpoint {'equals' if same else 'DIFFERS FROM'} {args.plan} ({len(saved)} layers)")
        status = status or (0 if same else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""examples/train.py with dropout and a stateful data cursor: the abandoned step of a
recovery consumes random numbers and advances the cursor, so a recovered run is only
bitwise identical if the runtime rewinds both to the last commit and replays them (and a
step computed twice by --verify-every only reproduces if both are rewound)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from train import build_model, make_batch

import launcher


class Cursor:
    """A data position that the loop advances itself (like a data loader)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict) -> None:
        self.pos = int(d["pos"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save")
    p.add_argument("--untracked-cursor", action="store_true", help="the cursor is not handed to resild (extra=)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Dropout(0.2), build_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cursor = Cursor()
    job = launcher.init(model, opt, extra=None if args.untracked_cursor else cursor)
    for _ in job.steps(args.steps):
        x, y = make_batch(0, cursor.pos, job.rank)
        cursor.pos += 1
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        job.commit()
    if args.save and job.rank == 0:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": job.step,
                "cursor": cursor.pos,
                "rng": torch.get_rng_state(),
            },
            args.save,
        )
    job.close()


if __name__ == "__main__":
    main()

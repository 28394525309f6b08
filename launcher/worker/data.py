"""A data cursor that resild can rewind and replay: a torchdata StatefulDataLoader
plus the epoch it is in. Pass it as `extra=` to `job.attach`; after a recovery
the next batch is the one the committed step would have read next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader


class ResumableLoader:
    """Endless batches over epochs: `next(loader)`; `state_dict` / `load_state_dict`."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.epoch = 0
        self._it: Iterator[Any] | None = None
        self._loaded: dict[str, Any] | None = None  # position loaded and not yet moved from

    def _set_epoch(self) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler reshuffles per epoch

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._set_epoch()
                # iter() draws a base seed from the global RNG; a resumed loader makes
                # one more iterator than an uninterrupted one, so keep it off that stream.
                with torch.random.fork_rng(devices=[]):
                    self._it = iter(self.loader)
                self._loaded = None
            try:
                return next(self._it)
            except StopIteration:
                self.epoch += 1
                self._it = None

    def state_dict(self) -> dict[str, Any]:
        if self._loaded is not None:
            return {"epoch": self.epoch, "loader": self._loaded}
        # A loader asked for its state right after load_state_dict builds an iterator to
        # answer, drawing from the global RNG: keep that off the training's stream too.
        with torch.random.fork_rng(devices=[]):
            return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch = int(sd["epoch"])
        self._set_epoch()
        self.loader.load_state_dict(sd["loader"])
        self._loaded = sd["loader"]
        self._it = None  # the next iter() resumes from the loaded position

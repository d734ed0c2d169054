"""The stream scheduler: spreads independent optimizer work over CUDA side streams."""

from __future__ import annotations

from kitsune.config import StreamConfig
from kitsune.subsystem import Subsystem


class StreamScheduler(Subsystem):
    """Holds the stream layout from :class:`StreamConfig`.

    Step-in-backward and multi-stream buckets are not built yet, so the scheduler stays inactive and says so;
    ``num_streams`` and the stream roles are what the config asked for.
    """

    name = "streams"

    def __init__(self, config: StreamConfig) -> None:
        super().__init__()
        self.config = config
        self.deactivate("not built yet: every update runs on the current stream")

    @property
    def num_streams(self) -> int:
        """Side streams the scheduler may use."""
        return self.config.num_streams

    @property
    def priority_streams(self) -> list[int]:
        return list(self.config.priority_streams)

    def report(self) -> dict[str, int | list[int]]:
        return {"num_streams": self.num_streams}

"""TensorBoard event files for the chief, written with the ``tensorboard`` package alone.

``torch.utils.tensorboard.SummaryWriter`` imports torch (some seconds of CPU on a
loaded host) for what the chief writes: scalars and text. :class:`EventWriter`
writes the same events through the same ``EventFileWriter`` (the file version
record first, then one ``Event`` per value), so TensorBoard and
``EventAccumulator`` read them exactly as they read a ``SummaryWriter``'s.
"""
from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class EventWriter:
    """``add_scalar``, ``add_text`` and ``close`` of a ``SummaryWriter``, without torch.

    ``OSError`` from the constructor when ``log_dir`` cannot be created, as ``SummaryWriter``.
    """

    def __init__(self, log_dir: str, flush_secs: float = 120, max_queue: int = 10):
        self._writer = EventFileWriter(str(log_dir), max_queue, flush_secs)
        self._closed = False

    def _add(self, summary: Summary, step: int, walltime: float | None) -> None:
        self._writer.add_event(Event(summary=summary, step=int(step),
                                     wall_time=time.time() if walltime is None else walltime))

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step, walltime)

    def add_text(self, tag: str, text: str, step: int, walltime: float | None = None) -> None:
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)]),
                  step, walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the file; a second close does nothing, as with ``SummaryWriter``."""
        if not self._closed:
            self._closed = True
            self._writer.flush()
            self._writer.close()

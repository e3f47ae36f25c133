"""TensorBoard event files written with the ``tensorboard`` package's own writer (no TensorFlow, no torch).

``tensorboard`` rather than ``tensorboardX`` or ``torch.utils.tensorboard``: its writer imports in about
0.4 s without torch, so the login node's report can write scalars too (tensorboardX imports torch when
it is installed: 2.8 s measured here); and TensorBoard reads what its own writer wrote. Scalars are
``simple_value`` (float32) as Megatron-LM's ``SummaryWriter`` writes them; text entries use the text
plugin's format. Every write is flushed, like ``metrics.jsonl``: a killed rank loses no written point.
Each process writes its own ``events.out.tfevents.*`` file in the one folder; TensorBoard shows the
folder's files as one run.
"""

from __future__ import annotations

import time
from typing import Iterable

from megatron_resilience.dashboards.series import Point

INSTALL_HINT = "pip install 'megatron-resilience[tensorboard]' (or pip install tensorboard)"


def import_writer():
    """tensorboard's EventFileWriter and protos; ImportError with what to install."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as err:
        raise ImportError(f"TensorBoard event files need the tensorboard package: {INSTALL_HINT} ({err})",
                          name=err.name) from None  # the module that was missing, for callers that skip the files
    return EventFileWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2


class EventWriter:
    def __init__(self, logdir: str, *, filename_suffix: str = "") -> None:
        writer_cls, self._event, self._summary, self._tensor, self._shape = import_writer()
        self.logdir = logdir
        self._writer = writer_cls(logdir, filename_suffix=filename_suffix)

    def _value(self, point: Point):
        s = self._summary
        if isinstance(point.value, str):
            tensor = self._tensor.TensorProto(
                dtype=7, string_val=[point.value.encode()],  # DT_STRING
                tensor_shape=self._shape.TensorShapeProto(dim=[self._shape.TensorShapeProto.Dim(size=1)]))
            meta = s.SummaryMetadata(plugin_data=s.SummaryMetadata.PluginData(plugin_name="text"))
            return s.Summary.Value(tag=point.tag, metadata=meta, tensor=tensor)
        return s.Summary.Value(tag=point.tag, simple_value=float(point.value))

    def write(self, points: Iterable[Point], *, wall_time: float | None = None) -> None:
        by_step: dict[int, list] = {}
        for point in points:
            by_step.setdefault(point.step, []).append(self._value(point))
        now = time.time() if wall_time is None else wall_time
        for step, values in by_step.items():
            self._writer.add_event(self._event.Event(wall_time=now, step=step,
                                                     summary=self._summary.Summary(value=values)))
        if by_step:
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()

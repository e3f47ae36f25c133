"""TEST STAND-IN for nvidia-resiliency-ext's CUPTI C++ extension (``nvrx_cupti_module``), which needs CUDA and
libcupti and cannot load on this CPU-only machine. Only this extension is replaced; the real ``Detector``,
report generation, scoring and our integration run unchanged.

CUPTI times the GPU kernels a rank runs between ``start()`` and ``stop()``. On CPU the closest honest measure
of "this rank's own compute" is the CPU time of the profiling (main) thread over the same window: time spent
blocked in a gloo collective waiting for a slower peer is not CPU time, just as waiting is not kernel time on a
GPU. It is reported as one "kernel" so the Detector's GPU performance scores are computed from it.
"""

import statistics
import time


class _Stats:
    def __init__(self, values):
        self.min, self.max = min(values), max(values)
        self.median = statistics.median(values)
        self.avg = statistics.fmean(values)
        self.stddev = statistics.pstdev(values) if len(values) > 1 else float("nan")
        self.num_calls = len(values)


class CuptiProfiler:
    KERNEL = "cpu_compute_stand_in_for_cupti"

    def __init__(self, bufferSize=1_000_000, numBuffers=8, statsMaxLenPerKernel=4096):
        self.max_len = statsMaxLenPerKernel
        self.samples = []
        self.started_at = None

    def initialize(self):
        pass

    def shutdown(self):
        self.samples.clear()

    def start(self):
        self.started_at = time.thread_time()

    def stop(self):
        if self.started_at is not None:
            self.samples.append((time.thread_time() - self.started_at) * 1e3)
            self.samples = self.samples[-self.max_len:]
            self.started_at = None

    def get_stats(self):
        return {self.KERNEL: _Stats(self.samples)} if self.samples else {}

    def reset(self):
        self.samples.clear()

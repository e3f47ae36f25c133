"""What an NVIDIA Xid code means for the attempt that logged it: its severity, and whether it points at the machine.

An Xid line (``NVRM: Xid (PCI:0000:3b:00): 63, ... Row Remapper: New row marked for remapping``) is the driver's
report of an event, and the events differ: some record a repair the driver already made (the node is healthy),
some are usually the application's own fault (an illegal address, a channel the application's exit tore down),
and some mean the GPU or the node must be reset or replaced. Reading every Xid as a fatal hardware error fails
healthy attempts and excludes healthy nodes; reading none as one restarts on a broken GPU.

Source of every row: NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
its "Resolution Bucket" columns) and the dynamic page retirement guide
(https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html: 63 "a page has successfully been retired",
64 "failed retirement"). Severity here is this package's reading for a training job:

- ``info``: the driver handled it; never decides an attempt, never blames a node.
- ``warning``: recorded, never decides: a machine event that did not stop the application (its node is named as
  a hardware suspect only if another line decides a hardware failure).
- ``warning`` too for a code that is usually the application's (the catalog's RESTART_APP bucket): the
  application's own error (its traceback, its exit) decides, and the node is not blamed for it.
- ``fatal``: the GPU or node needs a reset or more (RESET_GPU, RESTART_BM, CONTACT_SUPPORT buckets); decides, and
  blames the node.

A code not in the table keeps the reading every Xid had before this table: fatal, pointing at the machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XidCode:
    meaning: str
    severity: str  # info | warning | error | fatal (taxonomy.SEVERITIES)
    points_at: str  # "machine" | "application" | "handled"


XID_CODES: dict[int, XidCode] = {
    13: XidCode("graphics engine exception (usually the application: an illegal instruction or address)", "warning",
                "application"),
    31: XidCode("GPU memory page fault (usually the application: an illegal memory access)", "warning", "application"),
    43: XidCode("GPU stopped processing: the driver reset the application's channel", "warning", "application"),
    45: XidCode("preemptive cleanup after earlier errors or the application's termination", "warning", "application"),
    48: XidCode("double-bit (uncorrectable) ECC error", "fatal", "machine"),
    61: XidCode("internal micro-controller breakpoint/warning", "fatal", "machine"),
    62: XidCode("internal micro-controller halt", "fatal", "machine"),
    63: XidCode("ECC page retirement or row remapping recorded (applies at the next GPU reset)", "info", "handled"),
    64: XidCode("ECC page retirement or row remapping could not be recorded", "warning", "machine"),
    74: XidCode("NVLink error", "fatal", "machine"),
    79: XidCode("GPU has fallen off the bus", "fatal", "machine"),
    92: XidCode("high single-bit ECC error rate (corrected)", "warning", "machine"),
    94: XidCode("contained ECC error (the application using the memory must restart)", "fatal", "machine"),
    95: XidCode("uncontained ECC error (every application on the GPU is affected; reset the GPU)", "fatal", "machine"),
    119: XidCode("GSP RPC timeout", "fatal", "machine"),
    120: XidCode("GSP error", "fatal", "machine"),
}
UNKNOWN = XidCode("not in this package's table: read as a fatal GPU error", "fatal", "machine")


def xid_code(text: str | None) -> XidCode:
    """The table's row for a code as a log line wrote it ("63"); UNKNOWN for one not in the table."""
    try:
        return XID_CODES.get(int(text or ""), UNKNOWN)
    except ValueError:
        return UNKNOWN

"""What a run cost and what it could have cost: goodput arithmetic shared by the report (login node) and the
trainer (compute node), stdlib only.

:mod:`.daly` holds Young's and Daly's optimum checkpoint interval and the expected efficiency of an
interval; :mod:`.history` reads a run's checkpoint cost and failure rate from its own records;
:mod:`.spans` tiles an allocation with labelled spans, :mod:`.accounting` puts every allocated second of a run
in one bucket (productive or a badput cause), :mod:`.optimum` measures C, R and M from it and compares the run
with Daly's E*.
"""
